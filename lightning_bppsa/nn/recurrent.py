"""BPPSA versions of ``torch.nn.RNN`` / ``GRU`` / ``LSTM`` (BPPSA Sec. 4.1-4.2, Appendix E).

Each class subclasses its torch module (same constructor, parameter names, ``state_dict`` keys, inputs
and outputs, incl. ``batch_first``, ``h0`` / ``(h0, c0)`` and unbatched input). With gradients enabled,
the stack runs layer by layer and direction by direction through
:class:`~lightning_bppsa.nn._recurrent_cells.LayerFunction` (torch's fused forward, scan backward);
dropout between layers is an ordinary autograd op, so its mask is the forward's.

``algorithm`` (``"auto"``, ``"linear"``, ``"blelloch"``, ``"chunked"``) picks the scan; with ``"auto"``,
when :func:`~lightning_bppsa.cost_model.recurrent_path` predicts that the scan does not pay, the module
runs torch's own forward under plain autograd instead. ``last_stats`` records what the last forward did:
``path`` (``"scan"`` / ``"autograd"``), ``algorithm``, ``jacobian_seconds`` (forward time spent on
Jacobian data), ``scan_seconds`` (backward scan time) and ``scan_algorithm`` (what the scan resolved
``algorithm`` to, e.g. ``"linear"`` or ``"chunked(c=8)"``), the last two filled in by the backward.

Not supported (raise ``NotImplementedError``; use the torch module): ``proj_size > 0`` (LSTM) and
``PackedSequence`` input.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from lightning_bppsa import cost_model
from lightning_bppsa.nn._recurrent_cells import LayerFunction
from lightning_bppsa.nn.convert import Conversion, register_converter
from lightning_bppsa.scan import ALGORITHMS

__all__ = ["GRU", "LSTM", "RNN"]


class _ScanRecurrent:
    """Mixin over ``nn.RNNBase``: the layer-by-layer scan forward shared by the three cells."""

    def _init_scan(self, algorithm: str) -> None:
        if getattr(self, "proj_size", 0) > 0:
            raise NotImplementedError(
                f"lightning_bppsa.nn.{type(self).__name__} does not support proj_size > 0; use torch.nn.LSTM"
            )
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}; got {algorithm!r}")
        self.algorithm = algorithm
        self.last_stats: dict[str, Any] = {}

    def forward(self, input: Tensor, hx: Any = None):  # noqa: A002  (torch's argument name)
        if isinstance(input, PackedSequence):
            raise NotImplementedError(
                f"lightning_bppsa.nn.{type(self).__name__} does not take a PackedSequence; "
                f"pad the batch or use torch.nn.{type(self).__name__}"
            )
        params = [p for p in self._flat_weights if p is not None]
        grads = torch.is_grad_enabled() and (input.requires_grad or any(p.requires_grad for p in params))
        batch_dim = 0 if self.batch_first else 1
        batch = input.shape[batch_dim] if input.dim() == 3 else 1
        length = input.shape[1 - batch_dim] if input.dim() == 3 else input.shape[0]
        path = "scan"
        if not grads:
            path = "autograd"
        elif self.algorithm == "auto":
            path = cost_model.recurrent_path(
                self.mode, n=length, hidden=self.hidden_size, batch=batch, device=input.device.type
            )
        self.last_stats = {
            "path": path,
            "algorithm": self.algorithm,
            "jacobian_seconds": 0.0,
            "scan_seconds": 0.0,
        }
        if path == "autograd":
            return super().forward(input, hx)
        return self._scan_forward(input, hx)

    def _scan_forward(self, input: Tensor, hx: Any):  # noqa: A002
        is_lstm = self.mode == "LSTM"
        unbatched = input.dim() == 2
        if input.dim() not in (2, 3):
            raise ValueError(f"input must be 2-D (unbatched) or 3-D; got shape {tuple(input.shape)}")
        x = input.unsqueeze(0) if unbatched else (input if self.batch_first else input.transpose(0, 1))
        batch, hidden, dirs = x.shape[0], self.hidden_size, 2 if self.bidirectional else 1
        states = (hx,) if not is_lstm else (hx if hx is not None else (None, None))
        full = []
        for s in states:
            if s is None:
                s = x.new_zeros(self.num_layers * dirs, batch, hidden)
            elif unbatched:
                s = s.unsqueeze(1)
            expected = (self.num_layers * dirs, batch, hidden)
            if tuple(s.shape) != expected:
                raise ValueError(f"hx must have shape {expected}; got {tuple(s.shape)}")
            full.append(s)
        h0, c0 = full[0], (full[1] if is_lstm else None)
        mode, stats = self.mode, self.last_stats
        h_n, c_n = [], []
        for layer in range(self.num_layers):
            if layer > 0 and self.dropout > 0 and self.training:
                x = F.dropout(x, self.dropout, True)
            outs = []
            for direction in range(dirs):
                idx = layer * dirs + direction
                weights = tuple(getattr(self, name) for name in self._all_weights[idx])
                seq = x if direction == 0 else x.flip(1)
                c_init = c0[idx] if is_lstm else None
                result = LayerFunction.apply(mode, self.algorithm, stats, seq, h0[idx], c_init, *weights)
                out = result[0] if is_lstm else result
                h_n.append(out[:, -1])
                if is_lstm:
                    c_n.append(result[1])
                outs.append(out if direction == 0 else out.flip(1))
            x = torch.cat(outs, -1) if dirs == 2 else outs[0]
        output = x.squeeze(0) if unbatched else (x if self.batch_first else x.transpose(0, 1))
        h_n_t = torch.stack(h_n, 1 if unbatched else 0)
        h_n_t = h_n_t.squeeze(0) if unbatched else h_n_t
        if not is_lstm:
            return output, h_n_t
        c_n_t = torch.stack(c_n, 0)
        return output, (h_n_t, c_n_t.squeeze(1) if unbatched else c_n_t)


class RNN(_ScanRecurrent, nn.RNN):
    """``torch.nn.RNN`` whose backward runs through the scan (``J_t = diag(f'_t) W_hh``).

    Args: as ``torch.nn.RNN``, plus keyword ``algorithm`` (default ``"auto"``).

    Example:
        >>> rnn = RNN(1, 20, batch_first=True)
        >>> out, h_n = rnn(torch.randn(4, 100, 1))
        >>> out.shape, h_n.shape
        (torch.Size([4, 100, 20]), torch.Size([1, 4, 20]))
    """

    def __init__(self, *args: Any, algorithm: str = "auto", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_scan(algorithm)


class GRU(_ScanRecurrent, nn.GRU):
    """``torch.nn.GRU`` whose backward runs through the scan (Appendix E, Eq. 11). Args: as ``torch.nn.GRU``
    plus keyword ``algorithm``."""

    def __init__(self, *args: Any, algorithm: str = "auto", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_scan(algorithm)


class LSTM(_ScanRecurrent, nn.LSTM):
    """``torch.nn.LSTM`` whose backward runs through the scan over the joint state ``[h; c]``.
    Args: as ``torch.nn.LSTM`` plus keyword ``algorithm``; ``proj_size > 0`` is not supported."""

    def __init__(self, *args: Any, algorithm: str = "auto", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_scan(algorithm)


_TYPES = {nn.RNN: RNN, nn.GRU: GRU, nn.LSTM: LSTM}


@register_converter
def _convert_recurrent(module: nn.Module) -> Conversion | None:
    """Swap an exact ``torch.nn.RNN/GRU/LSTM`` for its BPPSA class, keeping the same ``Parameter`` objects."""
    target = _TYPES.get(type(module))
    if target is None:
        return None
    if getattr(module, "proj_size", 0) > 0:
        return Conversion(None, "proj_size > 0 is not supported by the scan; stays on torch autograd")
    kwargs = dict(
        input_size=module.input_size,
        hidden_size=module.hidden_size,
        num_layers=module.num_layers,
        bias=module.bias,
        batch_first=module.batch_first,
        dropout=module.dropout,
        bidirectional=module.bidirectional,
        device="meta",
    )
    if isinstance(module, nn.RNN):
        kwargs["nonlinearity"] = module.nonlinearity
    new = target(**kwargs)
    for name in module._flat_weights_names:
        setattr(new, name, getattr(module, name))
    new.train(module.training)
    return Conversion(new, f"{type(module).__name__}: backward through the scan (algorithm 'auto')")
