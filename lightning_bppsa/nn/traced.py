"""Layer chains written as code in ``forward()``: found with ``torch.fx``, rewritten into :class:`SparseChain` s.

``convert(model, trace=True)`` runs :func:`convert_traced` on every module of a user-defined class (not
``torch.nn``'s, not already BPPSA): it traces the module's ``forward`` symbolically (``torch.fx``; BPPSA
modules stay leaves), finds *runs* of consecutive operations with a supported layer form, each feeding
only the next, and rewrites every run that :func:`~lightning_bppsa.nn.chain.convert_chain` would wrap
(at least ``MIN_LAYERS`` layers, a ``Conv2d``, nothing the scan refuses) into a ``SparseChain`` submodule
of a ``torch.fx.GraphModule`` that replaces the module. Supported forms: every module the scan has a
Jacobian for (``self.conv1(x)``, including the layers of an ``nn.Sequential`` it calls), and
``F.relu`` / ``torch.relu`` / ``x.relu()``, ``F.leaky_relu``, ``torch.tanh`` / ``x.tanh()``,
``torch.sigmoid`` / ``x.sigmoid()``, ``F.max_pool2d``, ``F.avg_pool2d``, ``torch.flatten`` /
``x.flatten()``, ``F.conv2d`` and ``F.linear`` on parameters of the module. The chains reuse the very
module and ``Parameter`` objects; the functional forms become new parameter-free modules
(``nn.ReLU()``...), or, for ``F.conv2d`` / ``F.linear``, new modules holding the same ``Parameter`` s.

What a GraphModule does not keep, and so where a module is left alone (the report says why):

- a class that defines public methods or properties besides ``forward`` (a ``GraphModule`` has only the
  traced ``forward``): e.g. every ``LightningModule``;
- a ``forward`` that does not use every parameter and buffer of the module (the rest would be dropped);
- a ``forward`` that ``torch.fx`` cannot trace (control flow on tensor values, ...).

Tracing records one path through the Python code: a ``forward`` that branches on ``self.training`` or
on shapes follows the branch taken while tracing, which is why it is opt-in. In-place functional forms
(``F.relu(x, inplace=True)``), ``F.dropout`` (its ``training`` flag is baked in), and ``x.view(...)``
are not chain layers. The layers of a rewritten chain move under its name in ``state_dict``
(``conv1.weight`` becomes ``bppsa_chain_0.conv1.weight``): load checkpoints of the original model
before converting it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from lightning_bppsa.jacobians import is_supported
from lightning_bppsa.nn.chain import convert_chain
from lightning_bppsa.nn.convert import Conversion, is_converted, register_converter

__all__ = ["convert_traced", "explain_untraced"]

#: parameter names of the functional forms, in positional order (the input first), and their defaults
_SIGNATURES: dict[Any, tuple[tuple[str, ...], dict[str, Any]]] = {
    "relu": (("input", "inplace"), {"inplace": False}),
    "leaky_relu": (("input", "negative_slope", "inplace"), {"negative_slope": 0.01, "inplace": False}),
    "tanh": (("input",), {}),
    "sigmoid": (("input",), {}),
    "flatten": (("input", "start_dim", "end_dim"), {"start_dim": 0, "end_dim": -1}),
    "max_pool2d": (
        ("input", "kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices"),
        {"stride": None, "padding": 0, "dilation": 1, "ceil_mode": False, "return_indices": False},
    ),
    "avg_pool2d": (
        ("input", "kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override"),
        {
            "stride": None,
            "padding": 0,
            "ceil_mode": False,
            "count_include_pad": True,
            "divisor_override": None,
        },
    ),
    "conv2d": (
        ("input", "weight", "bias", "stride", "padding", "dilation", "groups"),
        {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1},
    ),
    "linear": (("input", "weight", "bias"), {"bias": None}),
}
#: call_function targets -> their form (call_method nodes use the method's name)
_FUNCTIONS = {
    F.relu: "relu",
    torch.relu: "relu",
    F.leaky_relu: "leaky_relu",
    torch.tanh: "tanh",
    torch.sigmoid: "sigmoid",
    torch.flatten: "flatten",
    F.max_pool2d: "max_pool2d",
    torch.max_pool2d: "max_pool2d",
    F.avg_pool2d: "avg_pool2d",
    F.conv2d: "conv2d",
    F.linear: "linear",
}
_METHODS = {"relu", "tanh", "sigmoid", "flatten"}


def _conv2d(weight: nn.Parameter, bias: nn.Parameter | None, **config: Any) -> nn.Conv2d:
    out_channels, in_per_group, *kernel = weight.shape
    conv = nn.Conv2d(
        in_per_group * config["groups"],
        out_channels,
        tuple(kernel),
        bias=bias is not None,
        device="meta",
        **config,
    )
    conv.weight, conv.bias = weight, bias  # the module's own Parameters, not copies
    return conv


def _linear(weight: nn.Parameter, bias: nn.Parameter | None) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight, linear.bias = weight, bias
    return linear


def _pool_stride(stride: Any) -> Any:
    return None if stride in ([], ()) else stride  # torch.max_pool2d's default stride [] is the kernel


#: form -> the module computing it from the bound arguments (without the input)
_BUILDERS: dict[str, Callable[..., nn.Module | None]] = {
    "relu": lambda inplace: None if inplace else nn.ReLU(),
    "leaky_relu": lambda negative_slope, inplace: None if inplace else nn.LeakyReLU(negative_slope),
    "tanh": lambda: nn.Tanh(),
    "sigmoid": lambda: nn.Sigmoid(),
    "flatten": lambda start_dim, end_dim: nn.Flatten(start_dim, end_dim),
    "max_pool2d": lambda return_indices, stride, **kw: (
        None if return_indices else nn.MaxPool2d(stride=_pool_stride(stride), **kw)
    ),
    "avg_pool2d": lambda stride, **kw: nn.AvgPool2d(stride=_pool_stride(stride), **kw),
    "conv2d": _conv2d,
    "linear": _linear,
}


def _bind(node: fx.Node, form: str) -> dict[str, Any] | None:
    names, defaults = _SIGNATURES[form]
    if len(node.args) > len(names) or set(node.kwargs) - set(names):
        return None
    bound = {**defaults, **dict(zip(names, node.args, strict=False)), **node.kwargs}
    return bound if set(bound) == set(names) else None


def _layer(node: fx.Node, root: nn.Module) -> nn.Module | None:
    """The layer that ``node`` computes from its first argument alone, or ``None``."""
    if not node.args or not isinstance(node.args[0], fx.Node):
        return None
    if node.op == "call_module":
        module = root.get_submodule(node.target)
        return module if is_supported(module) and len(node.args) == 1 and not node.kwargs else None
    form = _FUNCTIONS.get(node.target) if node.op == "call_function" else None
    if node.op == "call_method" and node.target in _METHODS:
        form = node.target
    bound = None if form is None else _bind(node, form)
    if bound is None:
        return None
    bound.pop("input")
    for name in ("weight", "bias"):  # F.conv2d / F.linear: the module's own Parameters
        if isinstance(bound.get(name), fx.Node):
            arg = bound[name]
            if arg.op != "get_attr":
                return None
            bound[name] = root.get_parameter(arg.target)  # AttributeError for a buffer: not a layer
    if any(isinstance(value, fx.Node) for value in bound.values()):
        return None  # an argument computed at run time
    return _BUILDERS[form](**bound)


def _runs(graph: fx.Graph, root: nn.Module) -> list[list[tuple[fx.Node, nn.Module]]]:
    """Maximal runs of layer nodes where each one's only user is the next (whose input it is)."""
    runs: list[list[tuple[fx.Node, nn.Module]]] = []
    for node in graph.nodes:
        try:
            layer = _layer(node, root)
        except (AttributeError, TypeError, ValueError):  # an unusual call of a supported name: not a layer
            layer = None
        if layer is None:
            continue
        last = runs[-1][-1][0] if runs else None
        if last is not None and node.args[0] is last and len(last.users) == 1:
            runs[-1].append((node, layer))
        else:
            runs.append([(node, layer)])
    return runs


class _Tracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return is_converted(m) or super().is_leaf_module(m, module_qualified_name)


def _user_defined(module: nn.Module) -> bool:
    return not type(module).__module__.startswith("torch.") and not is_converted(module)


def _public_methods(module: nn.Module) -> list[str]:
    """Public methods and properties the class adds to ``nn.Module`` besides ``forward``."""
    names = set()
    for cls in type(module).__mro__:
        if cls.__module__.startswith("torch.") or cls is object:
            continue
        names |= {
            name
            for name, value in vars(cls).items()
            if not name.startswith("_")
            and name != "forward"
            and (callable(value) or isinstance(value, property))
        }
    return sorted(names)


def _describe(run: list[tuple[fx.Node, nn.Module]]) -> str:
    return ", ".join(node.name for node, _ in run)


@register_converter(traced=True)
def convert_traced(module: nn.Module) -> Conversion | None:
    """Rewrite the layer chains in a user-defined module's ``forward`` code into ``SparseChain`` s.

    Answers ``None`` for ``torch.nn`` and BPPSA modules (conversion recurses into them), else a
    :class:`~lightning_bppsa.nn.Conversion`: the ``GraphModule`` replacing the module, or ``None`` with
    what was looked at and why nothing qualified (see the module docstring).
    """
    if not _user_defined(module):
        return None
    name = type(module).__name__
    methods = _public_methods(module)
    if methods:
        return Conversion(
            None,
            f"not traced: {name} defines {', '.join(methods)} besides forward; a GraphModule keeps forward only",
        )
    try:
        graph = _Tracer().trace(module)
    except Exception as error:  # noqa: BLE001  (whatever fx raises, the model stays as it was)
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return Conversion(None, f"torch.fx could not trace {name}.forward: {type(error).__name__}: {first}")
    gm = fx.GraphModule(module, graph, class_name=f"Traced{name}")
    state = {id(t) for t in (*module.parameters(), *module.buffers())}
    kept = {id(t) for t in (*gm.parameters(), *gm.buffers())}
    if state != kept:
        return Conversion(None, f"not traced: {name}.forward does not use every parameter and buffer of it")
    runs = _runs(gm.graph, gm)
    if not runs:
        return Conversion(None, f"traced {name}.forward: no operation with a layer Jacobian")
    chains, refused = [], []
    for run in runs:
        layers = OrderedDict((node.name, layer) for node, layer in run)
        answer = convert_chain(nn.Sequential(layers))
        if answer is not None and answer.replacement is not None:
            chains.append((run, answer.replacement))
        else:
            refused.append(f"[{_describe(run)}]: {answer.reason if answer else 'not a chain'}")
    if not chains:
        return Conversion(None, f"traced {name}.forward, no chain qualifies: " + "; ".join(refused))
    described = []
    for index, (run, chain) in enumerate(chains):
        target = f"bppsa_chain_{index}"
        gm.add_submodule(target, chain)
        first, last = run[0][0], run[-1][0]
        with gm.graph.inserting_after(last):
            call = gm.graph.call_module(target, (first.args[0],))
        last.replace_all_uses_with(call)
        for node, _ in reversed(run):
            inputs = [arg for arg in node.all_input_nodes if arg.op == "get_attr"]
            gm.graph.erase_node(node)
            for arg in inputs:  # F.conv2d / F.linear parameters, now held by the chain's module
                if not arg.users:
                    gm.graph.erase_node(arg)
        described.append(f"{target} ({_describe(run)})")
    gm.graph.lint()
    gm.recompile()
    gm.delete_all_unused_submodules()
    reason = f"traced {name}.forward: sparse BPPSA scan over " + ", ".join(described)
    return Conversion(gm, reason + ("" if not refused else "; left on autograd: " + "; ".join(refused)))


@register_converter
def explain_untraced(module: nn.Module) -> Conversion | None:
    """Say why a user-defined module that calls ``Conv2d`` layers from its ``forward`` code is not converted
    (without ``trace=True`` only ``nn.Sequential`` chains are found); ``None`` for every other module."""
    if not _user_defined(module):
        return None
    convs = [name for name, child in module.named_children() if isinstance(child, nn.Conv2d)]
    if not convs:
        return None
    return Conversion(
        None,
        f"{type(module).__name__} calls {', '.join(convs)} from forward() code, not as an nn.Sequential: "
        "convert(model, trace=True) looks for chains in it with torch.fx",
    )
