"""Test utilities shared by the test suite and by users checking their own models.

Tolerances are derived, not guessed: a fast path in some dtype may be as far from the float64 truth
as ``factor`` times the plain baseline (autograd, or the linear scan) in the same dtype, plus a floor.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from unittest import mock

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_bppsa.algorithms import compute_dtype

__all__ = ["EmulatedGraphs", "OpCounter", "assert_derived_close", "cuda_path_on_cpu", "graphs_on_cpu", "relative_error"]


def relative_error(actual: Tensor, reference: Tensor) -> float:
    """Norm-wise relative error ``‖actual - reference‖ / ‖reference‖`` computed in float64."""
    actual, reference = actual.detach().double(), reference.detach().double()
    scale = reference.norm().item()
    diff = (actual - reference).norm().item()
    return diff / scale if scale > 0 else diff


#: flushed denormal terms an element may have lost (see :func:`assert_derived_close`)
FLUSHED_TERMS = 4


def assert_derived_close(
    actual: Tensor,
    reference: Tensor,
    baseline: Tensor | None = None,
    *,
    factor: float = 2.0,
    floor: float | None = None,
    name: str = "value",
) -> None:
    """Assert ``actual`` is as close to the float64 ``reference`` as ``baseline`` is, up to ``factor``.

    Args:
        actual: the fast path's result, any dtype.
        reference: the float64 ground truth.
        baseline: the plain implementation's result in ``actual``'s dtype; ``None`` uses only ``floor``.
        factor: allowed ratio of errors.
        floor: absolute floor on the relative error (default: 1e-12 for float64, 1e-5 otherwise).

    A difference whose norm is below ``FLUSHED_TERMS * finfo(actual.dtype).tiny * sqrt(numel)`` also passes:
    the scan flushes denormals to zero on CPU (they are ~10-100x slower on x86), which moves each term of an
    element by less than the smallest normal number, so a result that lies in or next to the denormal range
    may legitimately differ by a few of those (an LSTM gradient sums terms through both of its states).
    """
    if actual.shape != reference.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != reference {tuple(reference.shape)}")
    if floor is None:
        floor = 1e-12 if actual.dtype == torch.float64 else 1e-5
    allowed = floor + (factor * relative_error(baseline, reference) if baseline is not None else 0.0)
    error = relative_error(actual, reference)
    # half precision is computed (and flushed) in float32
    compute = compute_dtype(actual.dtype)
    flushed = (
        FLUSHED_TERMS * torch.finfo(compute).tiny * actual.numel() ** 0.5
        if actual.is_floating_point()
        else 0.0
    )
    if (
        not error <= allowed and not (actual.double() - reference.double()).norm().item() <= flushed
    ):  # NaN fails
        raise AssertionError(f"{name}: relative error {error:.3e} exceeds allowed {allowed:.3e}")


def _cuda_path_patches(run_kernels: bool = True) -> tuple[object, list[tuple[object, str, object]]]:
    """What :func:`cuda_path_on_cpu` replaces: ``(backend, [(target, name, value), ...])``, the CUDA backend it
    registers for ``"cpu"`` and the attributes it sets (a dict target's name is a key), for callers that patch
    with tools of their own (pytest's ``monkeypatch``, whose undo order must stay its own)."""
    from lightning_bppsa import backends, plan
    from lightning_bppsa.kernels import cuda, emulated, recurrent_emulated
    from lightning_bppsa.kernels.recurrent_cuda import SM80_OPTIN_SHARED_BYTES

    emulated_cuda = backends.CudaBackend(  # an SM 8.0 device: no thread-block clusters
        recurrent_emulated, "cpu", lambda device: SM80_OPTIN_SHARED_BYTES, lambda: (True, ""), lambda device: 1
    )
    real_choose = plan.choose
    scan_launch = emulated._launcher(None, 600.0, 1, 0.0) if run_kernels else lambda *launch: None
    patches = [
        (backends.DEVICE_BACKENDS, "cpu", emulated_cuda),
        (plan, "choose", lambda algorithm, *, device, **shape: real_choose(algorithm, device="cuda", **shape)),
        (cuda, "available", lambda: (True, "")),
        (cuda, "current_shared_limit", lambda: SM80_OPTIN_SHARED_BYTES),
        (cuda, "_launch_cuda", scan_launch),
        (cuda, "_device_limit", lambda t: SM80_OPTIN_SHARED_BYTES),
    ]  # fmt: skip
    if not run_kernels:
        patches.append((recurrent_emulated, "_launcher", lambda *config: lambda *launch: None))
    return emulated_cuda, patches


def _clear_plans() -> None:
    """Forget the scan plans and the layer calls' plans cached per shape and device type (where
    :func:`cuda_path_on_cpu` changes what ``"cpu"`` plans as)."""
    from lightning_bppsa import backends, plan

    plan._choose.cache_clear()
    backends._CALLS.clear()


@contextlib.contextmanager
def cuda_path_on_cpu(run_kernels: bool = True) -> Iterator[object]:
    """The recurrent layers' and the scans' CUDA path on CPU tensors (for machines without a GPU).

    Inside, the CUDA backend over the host emulation of the recurrent kernels (``kernels.recurrent_emulated``,
    needs g++) is the backend of ``"cpu"`` tensors (yielded), ``plan.choose`` answers as for a CUDA tensor, the
    scan kernels launch through their host emulation, on a device with an SM 8.0 block's shared memory; the
    plan caches are cleared on entry and exit. ``run_kernels=False``: every launch is prepared as on a GPU and
    then dropped (outputs left unwritten): the host's share of a step alone (``benchmarks/host_proxy.py``).
    """
    backend, patches = _cuda_path_patches(run_kernels)
    with contextlib.ExitStack() as stack:
        for target, name, value in patches:
            dict_item = isinstance(target, dict)
            stack.enter_context(
                mock.patch.dict(target, {name: value}) if dict_item else mock.patch.object(target, name, value)
            )
        _clear_plans()  # plans cached for "cpu" must not answer, nor these leak
        try:
            yield backend
        finally:
            _clear_plans()


class EmulatedGraphs:
    """A host stand-in for CUDA graphs (:func:`graphs_on_cpu`): a capture runs the work and keeps its result, a
    replay runs the work again and copies its result into the captured tensors (what a graph's replay leaves in
    its static tensors); ``run_graphs=False``: a replay does nothing. ``captures`` counts the captures,
    ``replays`` the replays (a forward graph's and a backward graph's each count)."""

    def __init__(self, run_graphs: bool = True) -> None:
        self.captures = self.replays = 0
        self.run_graphs = run_graphs

    def accepts(self, tensor: Tensor) -> bool:
        """Any device (the CUDA graphs take CUDA tensors only)."""
        return True

    def warm_up(self, fn: Callable[[], object], device: torch.device) -> None:
        """``fn`` once (no side stream on the host)."""
        fn()

    def capture(
        self, fn: Callable[[], list], pool: object, device: torch.device
    ) -> tuple[list, Callable[[list], None], object]:
        """``(fn's result, replay, pool)``, as :meth:`lightning_bppsa.nn._replay.CudaGraphs.capture`."""
        self.captures += 1
        result = fn()

        def replay(targets: list) -> None:
            self.replays += 1
            if not self.run_graphs:
                return
            fresh = fn()
            with torch.no_grad():
                for target, value in zip(targets, fresh, strict=True):
                    if target is not None:
                        target.copy_(value)

        return result, replay, pool


@contextlib.contextmanager
def graphs_on_cpu(run_graphs: bool = True) -> Iterator[EmulatedGraphs]:
    """Replayed scan steps (:mod:`lightning_bppsa.nn._replay`) on any device, over :class:`EmulatedGraphs`
    (yielded), for machines without a GPU: what a replay hands out, when it captures again and when it runs
    the eager scan are the CUDA path's; the graphs themselves are checked on a GPU. ``run_graphs=False``: a
    replay leaves the outputs as they are (the host's share of a replayed step: ``benchmarks/host_proxy.py``)."""
    from lightning_bppsa.nn import _replay

    graphs = EmulatedGraphs(run_graphs)
    with mock.patch.object(_replay, "GRAPHS", graphs):
        yield graphs


#: ops that queue no kernel on a GPU: views and allocations (of the caching allocator: no launch either)
_NO_LAUNCH = {"empty", "new_empty", "empty_like", "empty_strided", "lift_fresh", "detach"}


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that reach the dispatcher's Python key, by name (``with OpCounter() as c: ...``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def launching(self) -> int:
        """The ops that queue at least one kernel on a GPU (not views, not allocations)."""
        views = {name for name in self.ops if _is_view(name)}
        return sum(count for name, count in self.ops.items() if name not in _NO_LAUNCH and name not in views)


def _is_view(name: str) -> bool:
    packet = getattr(torch.ops.aten, name)
    return any(getattr(packet, overload).is_view for overload in packet.overloads())
