"""A torch recurrent cell as JAX, for a JAX baseline of the same cell math (``benchmarks/cells.py``).

The step ``cell(x_t, state) -> state`` is traced once by ``make_fx`` (functionalized, fake tensors of the
benchmark's row count) into aten ops, and the graph is interpreted in ``jax.numpy``, op for op, so the JAX arm
computes exactly the torch cell's math without a hand-written copy of each cell. An op without a counterpart in
:func:`_ops` raises :class:`NotTranslated` naming it. :func:`jax_steps` turns the translated step into the
jitted forward (with residuals), backward and whole step of the benchmark's loss over ``lax.scan``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import fx, nn
from torch.func import functional_call, functionalize
from torch.fx.experimental.proxy_tensor import make_fx

from lightning_bppsa.nn.cell_fused import FUSED_CELL_DECOMPOSITIONS

__all__ = ["NotTranslated", "jax_cell", "jax_steps", "to_jax"]


class NotTranslated(Exception):
    """The cell's traced step holds an op :data:`_OPS` has no JAX counterpart for."""


def _state_sizes(cell: nn.Module) -> tuple[int, ...]:
    size = cell.state_size
    return tuple(size) if isinstance(size, tuple) else (size,)


def _trace(cell: nn.Module, rows: int, inputs: int) -> fx.GraphModule:
    """The aten graph of ``(*parameters, x, *states) -> [*new states]`` at ``rows`` rows."""
    names = [name for name, _ in cell.named_parameters()]
    is_tuple = isinstance(cell.state_size, tuple)

    def step(*flat: torch.Tensor) -> list[torch.Tensor]:
        params, x, states = flat[: len(names)], flat[len(names)], flat[len(names) + 1 :]
        new = functional_call(
            cell, dict(zip(names, params, strict=True)), (x, states if is_tuple else states[0])
        )
        return list(new) if is_tuple else [new]

    like = next(cell.parameters())  # fake tensors on the cell's device and in its dtype, as its buffers are
    example = [
        torch.empty(rows, inputs, dtype=like.dtype, device=like.device),
        *(torch.empty(rows, s, dtype=like.dtype, device=like.device) for s in _state_sizes(cell)),
    ]
    with torch.no_grad():  # functionalized: writes through views become *_scatter ops
        # torch's fused CUDA cell ops (nn.LSTMCell / GRUCell on a GPU) as their pointwise math, as Recurrence traces them
        return make_fx(functionalize(step), FUSED_CELL_DECOMPOSITIONS, tracing_mode="fake")(
            *(p.detach() for p in cell.parameters()), *example
        )


def _slice(x: Any, dim: int = 0, start: int | None = None, end: int | None = None, step: int = 1) -> Any:
    index = [slice(None)] * x.ndim
    index[dim] = slice(start, end, step)
    return x[tuple(index)]


def _scatter(
    x: Any, src: Any, dim: int = 0, start: int | None = None, end: int | None = None, step: int = 1
) -> Any:
    index = [slice(None)] * x.ndim
    index[dim] = slice(start, end, step)
    return x.at[tuple(index)].set(src)


def _split(x: Any, size: int, dim: int = 0) -> list[Any]:
    return [_slice(x, dim, start, start + size) for start in range(0, x.shape[dim], size)]


def _split_sizes(x: Any, sizes: list[int], dim: int = 0) -> list[Any]:
    starts = np.cumsum([0, *sizes])
    return [_slice(x, dim, int(a), int(b)) for a, b in zip(starts[:-1], starts[1:], strict=True)]


def _ops(jax: Any) -> dict[Any, Callable[..., Any]]:
    """aten op -> its ``jax.numpy`` counterpart (aten's argument order and defaults)."""
    jnp, a = jax.numpy, torch.ops.aten
    return {
        operator.getitem: operator.getitem,
        a.t.default: lambda x: x.T,
        a.transpose.int: jnp.swapaxes,
        a.permute.default: jnp.transpose,
        a.mm.default: jnp.matmul,
        a.bmm.default: jnp.matmul,
        a.addmm.default: lambda bias, m1, m2, beta=1, alpha=1: beta * bias + alpha * (m1 @ m2),
        a.add.Tensor: lambda x, y, alpha=1: x + alpha * y,
        a.add.Scalar: lambda x, y, alpha=1: x + alpha * y,
        a.sub.Tensor: lambda x, y, alpha=1: x - alpha * y,
        a.sub.Scalar: lambda x, y, alpha=1: x - alpha * y,
        a.rsub.Scalar: lambda x, y, alpha=1: y - alpha * x,
        a.rsub.Tensor: lambda x, y, alpha=1: y - alpha * x,
        a.mul.Tensor: operator.mul,
        a.mul.Scalar: operator.mul,
        a.div.Tensor: operator.truediv,
        a.div.Scalar: operator.truediv,
        a.neg.default: operator.neg,
        a.reciprocal.default: jnp.reciprocal,
        a.pow.Tensor_Scalar: jnp.power,
        a.pow.Tensor_Tensor: jnp.power,
        a.exp.default: jnp.exp,
        a.log.default: jnp.log,
        a.sqrt.default: jnp.sqrt,
        a.rsqrt.default: jax.lax.rsqrt,
        a.abs.default: jnp.abs,
        a.sigmoid.default: jax.nn.sigmoid,
        a.tanh.default: jnp.tanh,
        a.relu.default: jax.nn.relu,
        a.silu.default: jax.nn.silu,
        a.gelu.default: lambda x, approximate="none": jax.nn.gelu(x, approximate=approximate == "tanh"),
        a.softplus.default: lambda x, beta=1, threshold=20: jnp.where(
            x * beta > threshold, x, jnp.log1p(jnp.exp(beta * x)) / beta
        ),
        a.leaky_relu.default: lambda x, slope=0.01: jax.nn.leaky_relu(x, slope),
        a.hardtanh.default: lambda x, low=-1.0, high=1.0: jnp.clip(x, low, high),
        a.clamp.default: lambda x, low=None, high=None: jnp.clip(x, low, high),
        a.clamp.Tensor: lambda x, low=None, high=None: jnp.clip(x, low, high),
        a.clamp_min.default: jnp.maximum,
        a.clamp_max.default: jnp.minimum,
        a.maximum.default: jnp.maximum,
        a.minimum.default: jnp.minimum,
        a.where.self: jnp.where,
        a.lerp.Tensor: lambda x, end, weight: x + weight * (end - x),
        a.lerp.Scalar: lambda x, end, weight: x + weight * (end - x),
        a.addcmul.default: lambda x, t1, t2, value=1: x + value * t1 * t2,
        a.addcdiv.default: lambda x, t1, t2, value=1: x + value * t1 / t2,
        a.split.Tensor: lambda x, size, dim=0: _split(x, size, dim),
        a.split_with_sizes.default: _split_sizes,
        a.unsafe_split.Tensor: _split,
        a.unsafe_split_with_sizes.default: _split_sizes,
        a.slice_scatter.default: _scatter,
        a.select_scatter.default: lambda x, src, dim, index: x.at[
            (slice(None),) * (dim % x.ndim) + (index,)
        ].set(src),
        a.copy.default: lambda x, src, non_blocking=False: jnp.broadcast_to(src, x.shape).astype(x.dtype),
        a.flip.default: lambda x, dims: jnp.flip(x, tuple(dims)),
        a.unbind.int: lambda x, dim=0: [jnp.take(x, i, axis=dim) for i in range(x.shape[dim])],
        a.slice.Tensor: _slice,
        a.select.int: lambda x, dim, index: jnp.take(x, index, axis=dim),
        a.view.default: jnp.reshape,
        a._unsafe_view.default: jnp.reshape,
        a.reshape.default: jnp.reshape,
        a.expand.default: lambda x, size: jnp.broadcast_to(
            x, tuple(x.shape[i - len(size) + x.ndim] if s == -1 else s for i, s in enumerate(size))
        ),
        a.unsqueeze.default: jnp.expand_dims,
        a.squeeze.dim: jnp.squeeze,
        a.cat.default: lambda xs, dim=0: jnp.concatenate(xs, axis=dim),
        a.stack.default: lambda xs, dim=0: jnp.stack(xs, axis=dim),
        a.sum.default: lambda x: jnp.sum(x),
        a.sum.dim_IntList: lambda x, dims, keepdim=False: jnp.sum(x, axis=tuple(dims), keepdims=keepdim),
        a.mean.dim: lambda x, dims, keepdim=False: jnp.mean(x, axis=tuple(dims), keepdims=keepdim),
        a.clone.default: lambda x, memory_format=None: x,
        a.alias.default: lambda x: x,
        a.detach.default: jax.lax.stop_gradient,
        a.lift_fresh_copy.default: lambda x: x,
    }


def _out_of_place(op: Any) -> Any:
    """``aten.add_.Tensor`` -> ``aten.add.Tensor``: the functional overload of an in-place op (else ``None``).

    Functionalization leaves the in-place ops of decompositions below it (``nn.LSTMCell``'s CPU kernel updates
    its gate chunks in place); they write tensors of their own, not views, and the trace reads a written tensor
    through the in-place op's node afterwards, so the functional op is exact."""
    if not isinstance(op, torch._ops.OpOverload) or not op._schema.name.endswith("_"):
        return None
    packet = getattr(torch.ops.aten, op._schema.name.split("::")[-1][:-1], None)
    return getattr(packet, op._overloadname, None) if packet is not None else None


def to_jax(jax: Any, tensor: torch.Tensor, device: Any = None) -> Any:
    """``tensor``'s values as a JAX array (on ``device``, else JAX's default)."""
    return jax.device_put(tensor.detach().cpu().numpy(), device)


def jax_cell(
    cell: nn.Module, rows: int, inputs: int, jax: Any
) -> Callable[[list[Any], tuple[Any, ...], Any], tuple[Any, ...]]:
    """``step(params, states, x) -> states`` in JAX: ``cell``'s traced step at ``rows`` rows, ``params`` in the
    order of ``cell.parameters()``; :class:`NotTranslated` names an op without a JAX counterpart."""
    gm = _trace(cell, rows, inputs)
    table = _ops(jax)
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    ops = {t: table.get(t) or table.get(_out_of_place(t)) for t in targets}
    missing = sorted(str(t) for t, fn in ops.items() if fn is None)
    if missing:
        raise NotTranslated(f"no JAX counterpart for {', '.join(missing)}")
    constants = {n: to_jax(jax, getattr(gm, n.target)) for n in gm.graph.nodes if n.op == "get_attr"}

    def step(params: list[Any], states: tuple[Any, ...], x: Any) -> tuple[Any, ...]:
        values = iter([*params, x, *states])
        env: dict[fx.Node, Any] = dict(constants)
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                env[node] = next(values)
            elif node.op == "call_function":
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
                env[node] = ops[node.target](*args, **kwargs)
            elif node.op == "output":
                return tuple(fx.node.map_arg(node.args[0], env.__getitem__))
        raise AssertionError("the traced step has no output")

    return step


def jax_steps(cell: nn.Module, rows: int, inputs: int, jax: Any) -> dict[str, Callable[..., Any]]:
    """The benchmark's loss (mean square of every step's output, zero state) of ``cell`` in JAX, jitted:
    ``forward(params, xs) -> (loss, vjp)`` (the residuals kept, as a forward recorded for a backward),
    ``backward(vjp) -> (param grads, xs grad)`` and ``step(params, xs) -> (loss, (param grads, xs grad))``
    (``jit(value_and_grad)``); ``xs`` time-major ``(T, rows, inputs)``."""
    jnp = jax.numpy
    cell_step = jax_cell(cell, rows, inputs, jax)
    sizes = _state_sizes(cell)

    def loss(params: list[Any], xs: Any) -> Any:
        def body(states: tuple[Any, ...], x: Any) -> tuple[tuple[Any, ...], Any]:
            states = cell_step(params, states, x)
            return states, states[0]

        zeros = tuple(jnp.zeros((xs.shape[1], s), xs.dtype) for s in sizes)
        _, outs = jax.lax.scan(body, zeros, xs)
        return jnp.mean(outs**2)

    return {
        "forward": jax.jit(lambda params, xs: jax.vjp(loss, params, xs)),
        "backward": jax.jit(lambda vjp, value: vjp(jnp.ones_like(value))),
        "step": jax.jit(jax.value_and_grad(loss, argnums=(0, 1))),
    }
