"""Where one recurrent layer call runs: device backends behind one interface, chosen once per call.

A backend runs the layer of a built-in cell (:mod:`lightning_bppsa.cells`, the math) on one kind of device,
forward and backward (:class:`Backend`):

- :data:`TORCH`: torch's fused forward with the Jacobian factors recomputed by torch ops; backward: the
  factored scan its plan names (:func:`lightning_bppsa.ops.execute_factored`: C sweeps, CUDA kernels or
  torch), then the cell's gate gradients. Runs anywhere: the reference of the other two.
- :data:`NATIVE`: the compiled CPU kernels (:mod:`lightning_bppsa.kernels.recurrent`): a forward emitting
  states and factors in one pass; a backward fusing the linear scan, the gate gradients and, for small
  layers, the parameter sums of Eq. 2 (only under the plan ``linear [c]``).
- :data:`CUDA`: the CUDA forward kernels (:mod:`lightning_bppsa.kernels.recurrent_cuda`); its backward is
  :data:`TORCH`'s, with the scan on the CUDA scan kernels (``[cuda]`` plans), but where a ``linear [cuda]``
  plan's factored scan would not be the warp-resident sweep (an LSTM, whose factored scan also needs ~20
  launches for its scales, or a state wider than a warp) and the kernel's block fits: there the fused
  backward kernel (:class:`FusedBackward`: the linear recursion and the gate gradients in one launch), which
  ``"auto"`` also plans where the model prices it below the chunked scan (:func:`scan_plan`). Where both
  kernels of a linear backward can run, or of a chunked one ``"auto"`` planned (the fused kernel runs the same
  recursion), the first backward of each shape times both on its own data and the faster runs from then on
  (:class:`MeasuredBackward`, :func:`lightning_bppsa.layer_plan.fastest`); the rule above (chunked: the scan
  planned) decides where nothing may measure (tracing, a CUDA graph capture, measurements off) or a
  measurement would take too long.

:func:`plan_call` decides, once per layer call and before anything runs, which backend runs the forward
and which the backward, and the scan's plan (:class:`LayerCall`): a kernel that cannot launch as planned
(a dtype, ``H`` beyond the threads of a block, weights beyond its shared memory) is planned as torch's
forward there, and the record says why; nothing falls back silently later. :func:`backward` runs a call's
backward (casts, the backend's gradients, the GEMMs of Eq. 2). :data:`DEVICE_BACKENDS` maps a device type
to its kernels' backend (tests register :class:`CudaBackend` over the host emulation for ``"cpu"``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from lightning_bppsa import cuda_step_model, layer_plan, ops, plan
from lightning_bppsa.algorithms import compute_dtype
from lightning_bppsa.cells import RecurrentCell
from lightning_bppsa.kernels import cuda as cuda_scan
from lightning_bppsa.kernels import cupy_loader, recurrent_cuda
from lightning_bppsa.kernels import recurrent as native

__all__ = [
    "CUDA", "DEVICE_BACKENDS", "NATIVE", "TORCH", "Backend", "CudaBackend", "FusedBackward", "LayerCall",
    "MeasuredBackward", "NativeBackend", "TorchBackend", "backward", "forward_backend", "fused_backward", "plan_call",
    "scan_plan",
]  # fmt: skip

log = logging.getLogger(__name__)

#: a backend's backward: ``(d_gi, d_gh, [∇h_0(, ∇c_0)], parameter gradients or None)`` (``None``: Eq. 2's GEMMs
#: run after it; ``d_gi`` / ``d_gh`` may be ``None`` where the backend summed the parameter gradients itself)
Gradients = tuple[Tensor | None, Tensor | None, Sequence[Tensor], list[Tensor] | None]

_KERNEL_DTYPES = (torch.float32, torch.float64)


class Backend(Protocol):
    """One way to run a built-in cell's layer, forward and backward, on one kind of device."""

    #: ``"torch"``, ``"cpu"`` (the compiled CPU kernels) or ``"cuda"`` (the CUDA kernels)
    name: str

    def refuses(self, cell: RecurrentCell, hidden: int, tensors: Sequence[Tensor | None]) -> str:
        """Why this backend cannot run a layer of ``cell`` (hidden size ``hidden``) on ``tensors`` (the op's
        inputs, ``x`` or a weight first, ``None`` skipped), ``""`` where it can. From shapes, dtypes and
        devices: never reads values."""
        ...

    def takes(self, scan: plan.Plan) -> bool:
        """Whether this backend's backward runs a scan planned as ``scan``."""
        ...

    def forward(
        self, cell: RecurrentCell, x: Tensor, h0: Tensor, c0: Tensor | None, weights: Sequence[Tensor]
    ) -> list[Tensor]:
        """``[out, (c_n,) *factors]`` of the layer over batch-first ``x`` (``cell.factor_shapes``)."""
        ...

    def backward(
        self, cell: RecurrentCell, scan: plan.Plan, x: Tensor, h0: Tensor, c0: Tensor | None, weights: Sequence[Tensor],
        out: Tensor, factors: Sequence[Tensor], grad_out: Tensor | None, grad_hn: Tensor | None,
        grad_cn: Tensor | None, need_x: bool,
    ) -> Gradients:  # fmt: skip
        """:data:`Gradients` from the gradients of ``out``, ``h_n`` and ``c_n`` (each may be ``None``); every
        tensor in the parameters' dtype."""
        ...


class TorchBackend:
    """Torch ops throughout (the scan: whatever kernel its plan names). See the module docstring."""

    name = "torch"

    def refuses(self, cell: RecurrentCell, hidden: int, tensors: Sequence[Tensor | None]) -> str:
        return ""

    def takes(self, scan: plan.Plan) -> bool:
        return True

    def forward(
        self, cell: RecurrentCell, x: Tensor, h0: Tensor, c0: Tensor | None, weights: Sequence[Tensor]
    ) -> list[Tensor]:
        return list(cell.torch_forward_with_factors(x, h0, c0, weights))

    def backward(
        self, cell: RecurrentCell, scan: plan.Plan, x: Tensor, h0: Tensor, c0: Tensor | None, weights: Sequence[Tensor],
        out: Tensor, factors: Sequence[Tensor], grad_out: Tensor | None, grad_hn: Tensor | None,
        grad_cn: Tensor | None, need_x: bool,
    ) -> Gradients:  # fmt: skip
        direct = cell.direct_gradients(grad_out, grad_hn, grad_cn, out)
        # values are read on the CPU only (on CUDA a sync; there a NaN may spread further than torch's)
        if out.device.type == "cpu" and cell.needs_select_sweep(out, grad_out, grad_hn):
            return cell.select_sweep(out, factors, weights[1], direct)
        jac = cell.jacobians(out, factors, weights[1])
        g = ops.execute_factored(scan, jac, direct)
        d_gi, d_gh = cell.gate_gradients(g[:, 1:], out, factors, jac)
        return d_gi, d_gh, g[:, 0].split(out.shape[-1], -1), None


def _mixed(tensors: Sequence[Tensor | None], device_type: str) -> str:
    """Why ``tensors`` (the first a tensor, ``None`` skipped) are not one strided set of one dtype on one
    ``device_type`` device (``""``: they are)."""
    first = tensors[0]
    for t in tensors:  # a plain loop: asked on every call of a layer
        if t is None:
            continue
        if t.dtype != first.dtype or t.device != first.device or t.layout != torch.strided:
            return "inputs of mixed dtypes, devices or layouts"
    if first.device.type != device_type:
        return f"tensors on {first.device.type}, not {device_type}"
    return ""


def _ran(result: tuple | None, backend: str, cell: RecurrentCell) -> tuple:
    """``result``, or a one-line error where a kernel the plan accepted declined to run (never a silent fallback)."""
    if result is None:
        raise RuntimeError(
            f"lightning_bppsa: the {backend} kernels declined a {cell.name} layer their plan accepted"
        )
    return result


class NativeBackend:
    """The compiled CPU cell kernels. See the module docstring."""

    name = "cpu"

    def refuses(self, cell: RecurrentCell, hidden: int, tensors: Sequence[Tensor | None]) -> str:
        why = _mixed(tensors, "cpu")
        if not why and tensors[0].dtype not in _KERNEL_DTYPES:
            why = f"dtype {tensors[0].dtype} (the compiled cell kernels take float32 / float64)"
        if not why and not native.available():
            why = "the compiled CPU cell kernels are unavailable (see the build log)"
        return why

    def takes(self, scan: plan.Plan) -> bool:
        return scan.kernel == "c" and scan.algorithm == "linear"

    def forward(
        self, cell: RecurrentCell, x: Tensor, h0: Tensor, c0: Tensor | None, weights: Sequence[Tensor]
    ) -> list[Tensor]:
        gi = cell.input_projection(x, weights, in_kernel=native.projects_inputs(x.shape[-1]))
        return list(_ran(cell.kernel_forward(native, gi, h0, c0, weights), self.name, cell))

    def backward(
        self, cell: RecurrentCell, scan: plan.Plan, x: Tensor, h0: Tensor, c0: Tensor | None, weights: Sequence[Tensor],
        out: Tensor, factors: Sequence[Tensor], grad_out: Tensor | None, grad_hn: Tensor | None,
        grad_cn: Tensor | None, need_x: bool,
    ) -> Gradients:  # fmt: skip
        hidden = out.shape[-1]
        sums = None
        if native.sums_parameters(hidden, x.shape[-1], cell.gates, out.dtype):
            sums = native.ParameterSums(x, out, h0, len(weights) == 4)
        result = cell.kernel_backward(
            native, out, c0, weights[1], factors, grad_out, grad_hn, grad_cn, sums, need_x
        )
        return _ran(result, self.name, cell)


def _device_limit(device: torch.device) -> int:
    return cuda_scan.device_shared_limit(
        device.index if device.index is not None else torch.cuda.current_device()
    )


def _device_clusters(device: torch.device) -> int:
    """The largest cluster of blocks the recurrent kernels launch on ``device`` (1 off CUDA: the host emulation
    of an SM 8.0 device)."""
    if device.type != "cuda":
        return 1
    return cupy_loader.cluster_limit(device.index if device.index is not None else torch.cuda.current_device())


class FusedBackward(TorchBackend):
    """A layer's backward as one CUDA kernel (``kernels.<cell>_backward``: the linear recursion with the gate
    gradients), then Eq. 2's GEMMs: the backward of the ``linear [cuda]`` calls :meth:`CudaBackend.fuses`
    (:meth:`CudaBackend.backward_for`). Its forward is never asked for: :class:`CudaBackend` runs that."""

    name = "cuda fused"

    def __init__(self, kernels) -> None:
        self.kernels = kernels

    def backward(
        self, cell: RecurrentCell, scan: plan.Plan, x: Tensor, h0: Tensor, c0: Tensor | None, weights: Sequence[Tensor],
        out: Tensor, factors: Sequence[Tensor], grad_out: Tensor | None, grad_hn: Tensor | None,
        grad_cn: Tensor | None, need_x: bool,
    ) -> Gradients:  # fmt: skip
        result = cell.kernel_backward(
            self.kernels, out, c0, weights[1], factors, grad_out, grad_hn, grad_cn, None, need_x
        )
        return _ran(result, self.name, cell)


class CudaBackend(TorchBackend):
    """The CUDA forward kernels; the backward is :class:`TorchBackend`'s (its scan on the CUDA scan kernels).

    Args:
        kernels: ``rnn_forward`` / ``gru_forward`` / ``lstm_forward`` with the signatures of
            :mod:`~lightning_bppsa.kernels.recurrent_cuda` (tests: :mod:`~lightning_bppsa.kernels.recurrent_emulated`).
        device_type: where ``kernels`` take their tensors.
        shared_limit: the shared memory a block may use on a device (what ``kernels`` launch with).
        available: ``(True, "")`` where ``kernels`` load, else ``(False, why)``.
        cluster_limit: the largest cluster of blocks ``kernels`` launch on a device (1: none).
    """

    name = "cuda"

    def __init__(
        self, kernels=recurrent_cuda, device_type: str = "cuda",
        shared_limit: Callable[[torch.device], int] = _device_limit,
        available: Callable[[], tuple[bool, str]] = recurrent_cuda.available,
        cluster_limit: Callable[[torch.device], int] = _device_clusters,
    ) -> None:  # fmt: skip
        self.kernels, self.device_type, self.shared_limit, self.available, self.cluster_limit = (
            kernels,
            device_type,
            shared_limit,
            available,
            cluster_limit,
        )
        self.fused = FusedBackward(kernels)

    def refuses(self, cell: RecurrentCell, hidden: int, tensors: Sequence[Tensor | None]) -> str:
        """The kernels' own answer (:func:`~lightning_bppsa.kernels.recurrent_cuda.refusal`, which their
        ``prepare`` obeys) for the device's shared memory, after the tensors' dtypes and devices agree and
        the kernels load; no allocation."""
        why = _mixed(tensors, self.device_type)
        if why:
            return why
        ok, why = self.available()
        if not ok:
            return why
        return recurrent_cuda.refusal(cell.name, hidden, tensors[0].dtype, *self._limits(tensors[0].device)) or ""

    def takes(self, scan: plan.Plan) -> bool:
        return scan.kernel == "cuda"

    def can_fuse(
        self, cell: RecurrentCell, hidden: int, dtype: torch.dtype, device: torch.device | str
    ) -> bool:
        """Whether the fused backward kernel can run a ``cell`` layer of ``hidden`` in ``dtype`` on ``device``:
        the kernels load and its block fits the device (``recurrent_cuda.backward_refusal``)."""
        if not self.available()[0]:
            return False
        return recurrent_cuda.backward_refusal(cell.name, hidden, dtype, *self._limits(torch.device(device))) is None

    def _limits(self, device: torch.device) -> tuple[int, int]:
        """``(shared_limit, cluster_limit)`` of ``device``: what the kernels' refusals and layouts take."""
        return self.shared_limit(device), self.cluster_limit(device)

    def row_blocks(
        self, cell: RecurrentCell, hidden: int, dtype: torch.dtype, device: torch.device, batch: int
    ) -> tuple[int, int]:
        """Blocks a batch row of the forward kernel and of the fused backward kernel take on ``device``: more
        than one where they run as a cluster (:func:`~lightning_bppsa.kernels.recurrent_cuda.launch_layout`)."""
        if dtype != torch.float32:
            return 1, 1
        limits, spread = self._limits(device), batch <= recurrent_cuda.SPREAD_BATCH
        layouts = (recurrent_cuda.launch_layout(cell.name, hidden, d, *limits, spread) for d in ("forward", "backward"))
        forward, backward = (1 if layout is None else layout.cluster for layout in layouts)
        return forward, backward

    def fuses(self, cell: RecurrentCell, hidden: int, dtype: torch.dtype, device: torch.device | str) -> bool:
        """Whether, unmeasured, a linear scan of a ``cell`` layer of ``hidden`` in ``dtype`` on ``device`` runs as
        the fused backward kernel: where it :meth:`can_fuse` and the factored scan's linear kernel is not the
        warp-resident sweep (an LSTM, or a state wider than a warp: the block sweep streams its operand tile
        from L2 every step, ~25 us a step at d = 128 on an H100). Where the warp sweep runs (RNN / GRU with
        H <= 32) it stays: measured there, the fused kernel not yet (a measured call chooses:
        :meth:`backward_for`)."""
        return not _warp_sweep(cell, hidden) and self.can_fuse(cell, hidden, dtype, device)

    def backward_for(
        self, cell: RecurrentCell, scan: plan.Plan, hidden: int, dtype: torch.dtype, device: torch.device,
        batch: int, steps: int, asked: str,
    ) -> tuple[Backend, str, bool]:  # fmt: skip
        """The backend of a call's backward planned ``scan`` (for ``asked``, the layer's algorithm) on these
        kernels, why where measured, and whether that answer is final (``False``: a measurement may still
        choose, now or on a later call where nothing may measure now). A linear scan that :meth:`can_fuse` has two kernels, the factored scan
        (this backend) and :attr:`fused`, and so has the chunked scan ``"auto"`` planned (the fused kernel runs
        the same recursion, linearly): the faster as measured for this shape
        (:func:`lightning_bppsa.layer_plan.fastest`); where the CUDA step model is sure which is faster (its two
        times :data:`SURE_BACKWARD` apart: the fused kernel above a warp, e.g. 0.3 vs 25 ms at d = 128 B = 16
        T = 1000, measured 0.4 vs 26 on an H200), that one, unmeasured (the slower one's runs cost up to seconds
        on the first call); else a :class:`MeasuredBackward` where its first backward may measure (both
        modelled to take at most :data:`~lightning_bppsa.layer_plan.MEASURE_BUDGET_SECONDS` three times), else
        :meth:`fuses`' rule (chunked: the scan planned). A chunked scan asked for, or any other: this backend."""
        chunked = scan.algorithm == "chunked" and asked == "auto"
        if not (scan.algorithm == "linear" or chunked) or not self.can_fuse(cell, hidden, dtype, device):
            return self, "", True
        key = (f"{scan.text} backward", cell.name, hidden, batch, steps, dtype, str(device))
        known = layer_plan.known_fastest(key)
        if known is not None:
            return (self.fused if known[0] == MeasuredBackward.FUSED else self), known[1], True
        fused, factored = _kernel_seconds(cell.gates, hidden, cell.state_factor * hidden, cell.jacobian_width(hidden),
                                          batch, steps, compute_dtype(dtype), scan)  # fmt: skip
        if max(fused, factored) >= SURE_BACKWARD * min(fused, factored):
            return (self.fused if fused < factored else self), "", True
        default = self if chunked or _warp_sweep(cell, hidden) else self.fused  # fuses(), can_fuse asked
        if 3 * (fused + factored) > layer_plan.MEASURE_BUDGET_SECONDS:
            return default, "", True
        if layer_plan.may_measure():
            return MeasuredBackward(self, key, default), "", False
        return default, "", False

    def forward(
        self, cell: RecurrentCell, x: Tensor, h0: Tensor, c0: Tensor | None, weights: Sequence[Tensor]
    ) -> list[Tensor]:
        gi = cell.input_projection(x, weights, in_kernel=False)
        return list(_ran(cell.kernel_forward(self.kernels, gi, h0, c0, weights), self.name, cell))


#: the model's two backward kernels of a linear CUDA scan this far apart: the faster runs, unmeasured. Wider
#: than the layer plan's :data:`~lightning_bppsa.layer_plan.UNSURE`: the fused kernel's constants are fitted on
#: the RNN's launches alone, and the GRU at H <= 32, modelled 2.3-4x apart, measured 1.1-1.4x (H200, 20dff7a;
#: at 54c70a0 the factored scan was the faster at B = 64), so those are measured; above a warp both cells are
#: modelled and measured 20-250x apart
SURE_BACKWARD = 5.0


def _warp_sweep(cell: RecurrentCell, hidden: int) -> bool:
    """Whether a linear factored scan of a ``cell`` layer of ``hidden`` is the warp-resident sweep (RNN / GRU with
    ``H`` up to a warp; an LSTM's state is ``2 H`` with five operand tiles)."""
    return cell.name != "lstm" and hidden <= cuda_scan.WARP


class MeasuredBackward(TorchBackend):
    """The backward of the first ``linear [cuda]`` call of a shape whose two kernels can both run
    (:meth:`CudaBackend.backward_for`): it times the factored scan and the fused kernel on the call's own
    inputs (:func:`lightning_bppsa.layer_plan.fastest`: once per shape; on a GPU it syncs on this call only),
    then returns the faster one's gradients; later calls of the shape plan that kernel directly. Where it may
    no longer measure when it runs (e.g. a capture began), ``default`` runs."""

    name = "cuda measured"
    FACTORED, FUSED = "factored scan", "fused kernel"

    def __init__(self, kernels: CudaBackend, key: tuple, default: Backend) -> None:
        self.kernels, self.key, self.default = kernels, key, default

    def backward(
        self, cell: RecurrentCell, scan: plan.Plan, x: Tensor, h0: Tensor, c0: Tensor | None, weights: Sequence[Tensor],
        out: Tensor, factors: Sequence[Tensor], grad_out: Tensor | None, grad_hn: Tensor | None,
        grad_cn: Tensor | None, need_x: bool,
    ) -> Gradients:  # fmt: skip
        args = (cell, scan, x, h0, c0, weights, out, factors, grad_out, grad_hn, grad_cn, need_x)
        kernels = {self.FACTORED: self.kernels, self.FUSED: self.kernels.fused}
        # each candidate's last run is timed, not kept: its results may live in the scan's scratch buffers
        runs = {name: functools.partial(k.backward, *args) for name, k in kernels.items()}
        chosen = layer_plan.fastest(self.key, runs, out.device)
        return (self.default if chosen is None else kernels[chosen[0]]).backward(*args)


TORCH, NATIVE, CUDA = TorchBackend(), NativeBackend(), CudaBackend()

#: the kernels' backend of each device type; a device type without one runs :data:`TORCH`
DEVICE_BACKENDS: dict[str, Backend] = {"cpu": NATIVE, "cuda": CUDA}


@dataclass(frozen=True)
class LayerCall:
    """What one layer call runs, decided before it runs (:func:`plan_call`).

    Attributes:
        forward: the forward's backend.
        backward: the backward's backend.
        scan: the backward's scan plan (kernel, algorithm, chunk).
        reason: why the forward runs torch's code where its device has kernels (``""`` otherwise).
        backward_reason: the measurement that chose the backward's kernel (``""``: none did).
        blocks: blocks a batch row of the CUDA forward kernel and of the fused backward kernel (a cluster
            where more than one: :meth:`CudaBackend.row_blocks`).
    """

    forward: Backend
    backward: Backend
    scan: plan.Plan
    reason: str = ""
    backward_reason: str = ""
    blocks: tuple[int, int] = (1, 1)

    def __str__(self) -> str:
        return self.text

    @functools.cached_property
    def text(self) -> str:  # once per plan: a memoised plan is reported on every call (plan_call)
        """``"scan chunked(c=16) [cuda]"``, plus ``" (chunked asked: why)"`` where the scan kernels cannot launch
        the algorithm asked for, ``", fused backward kernel"`` where that runs the backward
        (:class:`FusedBackward`), ``", backward kernel measured on its first call"`` where
        :class:`MeasuredBackward` will choose, the measurement in parentheses where one chose, and
        ``", torch forward: why"`` where the forward kernel cannot launch; then ``", clusters of 4 blocks a row"``
        (``"4 / 2 blocks"``: forward / fused backward) where a kernel runs as a cluster."""
        instead = f" ({self.scan.instead})" if self.scan.instead else ""
        kernel = (
            ", fused backward kernel" if isinstance(self.backward, FusedBackward)
            else ", backward kernel measured on its first call" if isinstance(self.backward, MeasuredBackward)
            else ", factored scan" if self.backward_reason else ""
        )  # fmt: skip
        measured = f" ({self.backward_reason})" if self.backward_reason else ""
        forward = f", torch forward: {self.reason}" if self.reason else ""
        blocks = self.blocks if isinstance(self.backward, FusedBackward) else self.blocks[:1]
        clusters = "" if max(blocks) == 1 else f", clusters of {' / '.join(dict.fromkeys(map(str, blocks)))} blocks a row"
        return f"scan {self.scan.text}{instead}{kernel}{measured}{forward}{clusters}"


#: reasons already logged for a torch forward on a device with kernels: once per reason, not per call
_LOGGED: set[str] = set()


def forward_backend(
    cell: RecurrentCell, hidden: int, tensors: Sequence[Tensor | None]
) -> tuple[Backend, str]:
    """The forward's backend of a layer on ``tensors`` (the op's inputs, ``x`` or a weight first; ``None``
    skipped) and, where its
    device's kernels refuse them, :data:`TORCH` with why (logged once per reason)."""
    device = tensors[0].device.type
    kernels = DEVICE_BACKENDS.get(device)
    why = (
        f"no compiled cell kernels for device {device}"
        if kernels is None
        else kernels.refuses(cell, hidden, tensors)
    )
    if not why:
        return kernels, ""
    if why not in _LOGGED:
        _LOGGED.add(why)
        log.info("lightning_bppsa: recurrent layers run torch's fused forward: %s", why)
    return TORCH, why


def scan_plan(
    cell: RecurrentCell, algorithm: str, *, batch: int, n: int, hidden: int, device: str, dtype: torch.dtype,
    shared_limit: int | None = None,
) -> plan.Plan:  # fmt: skip
    """The scan plan of a layer's backward (:func:`lightning_bppsa.plan.choose` over its factored Jacobians;
    ``shared_limit``: that of the CUDA device it runs on, ``None`` for torch's current device's)."""
    d, width = cell.state_factor * hidden, cell.jacobian_width(hidden)
    chosen = plan.choose(algorithm, n=n, d=d, batch=batch, width=width, device=device, dtype=dtype,
                         shared_limit=shared_limit)  # fmt: skip
    if algorithm != "auto" or chosen.kernel != "cuda" or chosen.algorithm == "linear":
        return chosen
    if not fused_backward(cell, hidden, dtype, device):
        return chosen
    # the linear scan would be the fused kernel, the chunked one the factored scan: the model's cheaper
    fused, chunked = _kernel_seconds(cell.gates, hidden, d, width, batch, n, compute_dtype(dtype), chosen)
    if chunked < fused:
        return chosen
    linear = plan.choose("linear", n=n, d=d, batch=batch, width=width, device=device, dtype=dtype,
                         shared_limit=shared_limit)  # fmt: skip
    why = (
        f"the fused backward kernel, modelled {fused * 1e3:.3g} ms vs {chosen.text}'s {chunked * 1e3:.3g} ms"
    )
    return dataclasses.replace(linear, reason=why)


@functools.lru_cache(maxsize=256)  # asked on every layer call with a chunked CUDA plan: once per shape
def _kernel_seconds(
    gates: int, hidden: int, d: int, width: int, batch: int, n: int, dtype: torch.dtype, chosen: plan.Plan
) -> tuple[float, float]:
    """The CUDA step model's seconds of the fused backward kernel and of the factored scan planned ``chosen``."""
    element_bytes = torch.finfo(dtype).bits // 8
    fused = cuda_step_model.fused_seconds(gates=gates, hidden=hidden, n=n, batch=batch, element_bytes=element_bytes)
    factored = cuda_step_model.kernel_seconds(chosen.algorithm, n=n, d=d, m=width, batch=batch, chunk=chosen.chunk,
                                              element_bytes=element_bytes)  # fmt: skip
    return fused, factored


def fused_backward(cell: RecurrentCell, hidden: int, dtype: torch.dtype, device: str) -> bool:
    """Whether a layer's linear scan on ``device`` runs as the fused backward kernel (:meth:`CudaBackend.fuses`
    of the device's kernels' backend)."""
    kernels = DEVICE_BACKENDS.get(device)
    return isinstance(kernels, CudaBackend) and kernels.fuses(cell, hidden, dtype, device)


def _scan_shared_limit(device: torch.device) -> int | None:
    """The shared memory per block of the CUDA device a scan runs on, where the scan kernels load (else
    ``None``: the plan does not ask)."""
    if device.type != "cuda" or not cuda_scan.available()[0]:
        return None
    return _device_limit(device)


#: :func:`plan_call`'s final plans (no measurement pending), by :func:`_call_key`: a training loop plans every step
_CALLS: dict[tuple, LayerCall] = {}
_MAX_CALLS = 256


def _call_key(cell: RecurrentCell, algorithm: str, x: Tensor, hidden: int) -> tuple:
    """What a plan of inputs that agree (one dtype, device and layout: :func:`_mixed`) depends on: the shape, the
    device (its limits), the device's kernels (tests register others), the decisions' cache generation."""
    device = x.device
    kernels = DEVICE_BACKENDS.get(device.type)
    return (cell.name, algorithm, x.shape[0], x.shape[1], hidden, x.dtype, device, kernels, layer_plan.generation())


def plan_call(
    cell: RecurrentCell, algorithm: str, x: Tensor, h0: Tensor, c0: Tensor | None, weights: Sequence[Tensor]
) -> LayerCall:
    """The plan of one layer call on the op's inputs (batch-first ``x``; in the dtypes the op computes in).

    The backward runs on the forward's backend where that takes the scan's plan (the CPU kernels' fused
    backward: ``linear [c]``; the CUDA kernels: a ``[cuda]`` scan), else on :data:`TORCH`.

    A final plan (no measurement pending, :meth:`CudaBackend.backward_for`) of inputs the forward kernels take is
    kept per shape, device and cache generation: later calls of inputs that agree get it back, asking nothing
    else (~9 us a layer call on this machine's CPU, more on a GPU's host, where each counts: issue 29).
    """
    hidden = h0.shape[-1]
    key = _call_key(cell, algorithm, x, hidden)
    known = _CALLS.get(key)
    if known is not None and not _mixed((x, h0, c0, *weights), x.device.type):
        return known
    call, final = _plan(cell, algorithm, x, h0, c0, weights)
    if final and not call.reason:  # a reason: the kernels refused these inputs (e.g. of mixed dtypes)
        if len(_CALLS) >= _MAX_CALLS:
            _CALLS.clear()
        _CALLS[key] = call
    return call


def _plan(
    cell: RecurrentCell, algorithm: str, x: Tensor, h0: Tensor, c0: Tensor | None, weights: Sequence[Tensor]
) -> tuple[LayerCall, bool]:
    """:func:`plan_call`'s plan, made from scratch, and whether it is final (no measurement pending)."""
    hidden = h0.shape[-1]
    forward, why = forward_backend(cell, hidden, (x, h0, c0, *weights))
    scan = scan_plan(cell, algorithm, batch=x.shape[0], n=x.shape[1], hidden=hidden, device=x.device.type,
                     dtype=weights[0].dtype, shared_limit=_scan_shared_limit(x.device))  # fmt: skip
    backward, measured, final = (forward if forward.takes(scan) else TORCH), "", True
    if isinstance(backward, CudaBackend):
        backward, measured, final = backward.backward_for(
            cell, scan, hidden, weights[0].dtype, x.device, x.shape[0], x.shape[1], algorithm
        )
    blocks = forward.row_blocks(cell, hidden, weights[0].dtype, x.device, x.shape[0]) if isinstance(
        forward, CudaBackend
    ) else (1, 1)  # fmt: skip
    return LayerCall(forward, backward, scan, why, measured, blocks), final


def backward(
    cell: RecurrentCell,
    algorithm: str,
    call: LayerCall | None,
    x: Tensor,
    h0: Tensor,
    c0: Tensor | None,
    weights: Sequence[Tensor],
    out: Tensor,
    factors: Sequence[Tensor],
    grad_out: Tensor | None,
    grad_hn: Tensor | None,
    grad_cn: Tensor | None,
    need_x: bool = True,
) -> list[Tensor]:
    """Every input gradient of one layer call: ``[grad_x, grad_h0, (grad_c0,) grad_W_ih, grad_W_hh, (grad_b_ih,
    grad_b_hh)]`` (``grad_x`` empty when not ``need_x``: a first layer's input seldom needs one).

    Runs ``call`` (the forward's plan; planned here from the inputs where ``None``: a dispatched op) in the
    parameters' dtype (under autocast the forward rounded its outputs to half precision)."""
    dtype = weights[0].dtype
    x_, out_, h0_, c0_, grad_out, grad_hn, grad_cn = [
        _cast(t, dtype) for t in (x, out, h0, c0, grad_out, grad_hn, grad_cn)
    ]
    factors = [_cast(f, dtype) for f in factors]
    if call is None:
        call = plan_call(cell, algorithm, x_, h0_, c0_, weights)
    d_gi, d_gh, starts, param_grads = call.backward.backward(
        cell, call.scan, x_, h0_, c0_, weights, out_, factors, grad_out, grad_hn, grad_cn, need_x
    )
    grad_x = (
        _cast((d_gi.reshape(-1, d_gi.shape[-1]) @ weights[0]).view(x.shape), x.dtype)
        if need_x
        else x.new_empty(0)
    )
    states = [_cast(starts[0], h0.dtype)] + ([_cast(starts[1], c0.dtype)] if c0 is not None else [])
    if param_grads is None:
        param_grads = cell.parameter_gradients(d_gi, d_gh, x_, h0_, out_, len(weights) == 4)
    return [grad_x, *states, *param_grads]


def _cast(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """``t.to(dtype)``, without its call where the dtype is already right (~2 µs each, ~8 per backward)."""
    return t if t is None or t.dtype == dtype else t.to(dtype)
