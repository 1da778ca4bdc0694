"""``BPPSAModelParallelStrategy`` (``"bppsa_model_parallel"``): a sequence split over ranks, backward as a scan.

Model parallelism over time (the paper's premise, Sec. 1 and 3.6): rank ``r`` of ``p`` owns the time
steps ``s_r + 1 .. s_{r+1}`` of every sequence (``T`` split as evenly as possible).

- Forward: rank ``r`` receives ``h_{s_r}`` from rank ``r - 1``, runs its segment with the ordinary
  (fast) RNN kernel, sends ``h_{s_{r+1}}`` on; the last state ``h_T`` is broadcast, so every rank
  computes the head and the loss identically.
- Backward: the step Jacobians ``J_t = diag(f'(a_t)) W_hh`` stay factored; the gradients of the
  segment's states come from :func:`lightning_bppsa.distributed.distributed_backprop_scan`
  (``Θ(T/p + log p)`` steps); the weight gradients are batched GEMMs over the segment
  (``∂l/∂W_hh = Σ_t (g_t ⊙ f'_t) h_{t-1}ᵀ``, Eq. 2) summed over ranks with one all-reduce.
  Head gradients are computed identically on every rank, so every rank takes the same optimizer step.

LightningModule contract:

- ``getattr(module, rnn_attribute)`` (default ``"rnn"``) is a ``torch.nn.RNN`` with one layer,
  ``tanh`` or ``relu``, unidirectional, ``batch_first=True``, no dropout.
- Its call ``rnn(x, h0=None)`` with the *whole* batch ``x: (B, T, I)`` (every rank loads the same batch)
  returns ``(None, h_n)``: the per-step outputs live on other ranks, so the loss may read only
  ``h_n: (1, B, H)`` (loss on the last state, the paper's RNN benchmark). ``x`` gets no gradient.
- Randomness in the head (dropout) must draw the same numbers on every rank (same seed).
- Data: every rank must see the same batches. As under DDP, Lightning replaces the training sampler
  by a ``DistributedSampler`` (here with one replica, so the same order on every rank, shuffled with
  its shared seed); ``Trainer(use_distributed_sampler=False)`` keeps the loader's own sampler.

Launch it like DDP: ``Trainer(strategy="bppsa_model_parallel", devices=p, accelerator="cpu")``, or with
processes started externally (``LOCAL_RANK`` etc. set); NCCL on GPUs, gloo on CPU.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from torch import Tensor, nn
from typing_extensions import override

from lightning_bppsa import distributed
from lightning_bppsa.cells import cell_of
from lightning_bppsa.jacobians.factored import FactoredJacobians

__all__ = ["BPPSAModelParallelStrategy", "ModelParallelRNN", "segment_bounds"]


def segment_bounds(length: int, rank: int, world: int) -> tuple[int, int]:
    """Steps ``[start, stop)`` (0-based) of rank ``rank``: ``length`` cut into ``world`` near-equal parts."""
    if length < world:
        raise ValueError(f"a sequence of {length} steps cannot be split over {world} ranks (>= 1 step each)")
    base, extra = divmod(length, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


class _SplitSequence(torch.autograd.Function):
    """``h_T`` of an Elman RNN whose time steps are split over the ranks of the world group."""

    @staticmethod
    def forward(ctx: Any, rnn: ModelParallelRNN, x: Tensor, h0: Tensor | None, *params: Tensor) -> Tensor:
        rank, world = dist.get_rank(), dist.get_world_size()
        start, stop = segment_bounds(x.shape[1], rank, world)
        x_seg = x[:, start:stop]
        batch, hidden = x.shape[0], rnn.hidden_size
        h_start = x.new_zeros(1, batch, hidden) if h0 is None else h0.reshape(1, batch, hidden).clone()
        try:
            if rank > 0:
                dist.recv(h_start, src=rank - 1)
            output, h_stop = nn.RNN.forward(rnn, x_seg, h_start)
            if rank < world - 1:
                dist.send(h_stop.contiguous(), dst=rank + 1)
            h_last = h_stop.contiguous()
            dist.broadcast(h_last, src=world - 1)
        except RuntimeError as error:  # gloo / NCCL report a dead or silent peer as RuntimeError
            raise distributed.DistributedScanError(
                f"bppsa_model_parallel forward, rank {rank}: passing the hidden state between ranks failed "
                f"(a peer died or did not answer within the process group's timeout): {error}"
            ) from error
        ctx.rnn, ctx.last = rnn, rank == world - 1
        ctx.save_for_backward(x_seg, torch.cat([h_start.transpose(0, 1), output], dim=1))
        return h_last

    @staticmethod
    def backward(ctx: Any, grad_last: Tensor) -> tuple[Tensor | None, ...]:
        x_seg, states = ctx.saved_tensors  # (B, n, I), (B, n + 1, H)
        rnn = ctx.rnn
        after = states[:, 1:]
        slope = cell_of(rnn.mode).slope(after)
        jac = FactoredJacobians(rnn.weight_hh_l0, slope)  # J_t = diag(f'(a_t)) W_hh
        g = distributed.distributed_backprop_scan(jac, grad_last[0] if ctx.last else None)
        pre = g[:, 1:] * slope  # ∂l/∂a_t, (B, n, H)
        grads = [
            torch.einsum("bth,bti->hi", pre, x_seg),
            torch.einsum("bth,btj->hj", pre, states[:, :-1]),
        ]
        if rnn.bias:
            grads += [pre.sum((0, 1)), pre.sum((0, 1))]
        flat = torch.cat([t.reshape(-1) for t in grads])
        dist.all_reduce(flat)
        reduced = list(flat.split([t.numel() for t in grads]))
        return (None, None, None, *(r.view_as(t) for r, t in zip(reduced, grads, strict=True)))


class ModelParallelRNN(nn.RNN):
    """``torch.nn.RNN`` (1 layer, batch_first) whose sequence is split over the ranks; see the module doc.

    Made from an existing ``nn.RNN`` in place by :meth:`adopt` (same ``Parameter`` objects, same
    ``state_dict`` keys). ``forward(x: (B, T, I), h0: (1, B, H) | None) -> (None, h_n: (1, B, H))``.
    """

    @classmethod
    def adopt(cls, rnn: nn.Module) -> ModelParallelRNN:
        """Turn ``rnn`` into a ``ModelParallelRNN`` in place, after checking it is supported."""
        if isinstance(rnn, cls):
            return rnn
        if type(rnn) is not nn.RNN:
            raise TypeError(
                f"strategy 'bppsa_model_parallel' splits a torch.nn.RNN; got {type(rnn).__name__}"
            )
        problems = [
            why
            for bad, why in (
                (rnn.num_layers != 1, f"num_layers={rnn.num_layers} (needs 1)"),
                (rnn.bidirectional, "bidirectional=True"),
                (not rnn.batch_first, "batch_first=False (needs True)"),
                (rnn.dropout != 0, "dropout != 0"),
                (rnn.proj_size if hasattr(rnn, "proj_size") else 0, "proj_size != 0"),
            )
            if bad
        ]
        if problems:
            raise ValueError("strategy 'bppsa_model_parallel' cannot split this RNN: " + ", ".join(problems))
        rnn.__class__ = cls
        return rnn

    @override
    def forward(self, x: Tensor, h0: Tensor | None = None) -> tuple[None, Tensor]:
        if x.dim() != 3:
            raise ValueError(f"x must be (B, T, I) (batch_first); got {tuple(x.shape)}")
        return None, _SplitSequence.apply(self, x, h0, *self._flat_weights)


class BPPSAModelParallelStrategy(DDPStrategy):
    """DDP-launched strategy that splits a recurrent layer's sequence over the ranks (model parallelism).

    Args:
        rnn_attribute: name of the LightningModule's ``torch.nn.RNN`` attribute to split.
        kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy` (``process_group_backend``,
            ``timeout``, ``start_method``, ...). No DDP wrapper is used: the split RNN all-reduces
            its own gradients and every other gradient is computed identically on every rank.

    Example:
        >>> pl.Trainer(strategy="bppsa_model_parallel", accelerator="cpu", devices=4)  # doctest: +SKIP
        >>> pl.Trainer(strategy=BPPSAModelParallelStrategy(rnn_attribute="encoder"), devices=4)  # doctest: +SKIP
    """

    strategy_name = "bppsa_model_parallel"

    def __init__(self, rnn_attribute: str = "rnn", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rnn_attribute = rnn_attribute

    @override
    def connect(self, model: pl.LightningModule) -> None:
        rnn = getattr(model, self.rnn_attribute, None)
        if rnn is None:
            raise AttributeError(
                f"strategy 'bppsa_model_parallel' needs the LightningModule to have a torch.nn.RNN "
                f"attribute {self.rnn_attribute!r} (set rnn_attribute=...)"
            )
        ModelParallelRNN.adopt(rnn)
        super().connect(model)

    @override
    def _setup_model(self, model: nn.Module) -> nn.Module:
        return model  # no DistributedDataParallel: gradients are reduced inside the split RNN's backward

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": 1, "rank": 0}  # every rank reads the whole batch; it keeps its time steps

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistry = StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="BPPSA model parallelism: sequence split over ranks, backward as a distributed scan",
            override=True,
        )


# the name exists as soon as the class does (see lightning_bppsa._registration)
BPPSAModelParallelStrategy.register_strategies()
