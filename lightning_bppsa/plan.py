"""The plan of one scan, decided once, at run time: which kernel runs which algorithm with which chunk.

:func:`choose` is the one place where a scan's kernel and algorithm are decided. The ``bppsa::`` ops
(:mod:`lightning_bppsa.ops`) call it inside their kernels, i.e. when the scan actually runs, with concrete
shapes, device and dtype: never while ``torch.compile`` traces (an answer there would be baked into the
graph), and without reading tensor values (a device sync on CUDA). A recurrent layer asks it once per call,
eagerly, in its forward (:func:`lightning_bppsa.backends.plan_call`), runs that plan and reports it.

- CUDA: the CuPy kernels (:mod:`lightning_bppsa.kernels.cuda`) where they load and the state fits them,
  with their own launch model (:mod:`lightning_bppsa.cuda_cost_model`); else the torch implementation.
  What the kernels can launch on the device is their own answer (:func:`lightning_bppsa.kernels.cuda.refusal`
  for the device's shared memory): a chunked scan they cannot launch is planned as the sweep, and the plan
  says so (:attr:`Plan.instead`); the launcher refuses what a plan did not check, it never substitutes.
- CPU: the torch implementation with its linear sweeps in the compiled C kernel
  (:mod:`lightning_bppsa.kernels.cpu`) where it builds; ``"auto"`` ranks the algorithms with
  :mod:`lightning_bppsa.cost_model`.
- Any other device: the torch implementation.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch

from lightning_bppsa import cost_model
from lightning_bppsa.algorithms import compute_dtype
from lightning_bppsa.cuda_cost_model import cuda_choose
from lightning_bppsa.kernels import cpu as cpu_kernel
from lightning_bppsa.kernels import cuda as cuda_kernel

__all__ = ["ALGORITHMS", "Plan", "check_algorithm", "choose"]

#: what a user may ask for; "auto" is resolved by :func:`choose`
ALGORITHMS = ("linear", "blelloch", "chunked", "auto")


def check_algorithm(algorithm: object, name: str = "algorithm") -> None:
    """Raise a one-line ``ValueError`` unless ``algorithm`` is one of :data:`ALGORITHMS`."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"{name} must be one of {ALGORITHMS}; got {algorithm!r}")


@dataclass(frozen=True)
class Plan:
    """What one scan runs.

    Attributes:
        kernel: ``"c"`` (the compiled CPU sweeps), ``"cuda"`` (the CuPy kernels) or ``"torch"``.
        algorithm: ``"linear"``, ``"blelloch"`` or ``"chunked"``.
        chunk: the chunk size of ``"chunked"`` (1 otherwise).
        reason: one line: why this kernel and algorithm.
        instead: where the algorithm asked for is not the one planned because the kernels cannot launch it
            (``"chunked asked: <why>"``), said wherever the plan is reported; ``""`` otherwise.
    """

    kernel: str
    algorithm: str
    chunk: int
    reason: str
    instead: str = ""

    def __str__(self) -> str:
        return self.text

    @cached_property
    def text(self) -> str:
        """``"chunked(c=16) [cuda]"``: written once per plan (plans are cached; a layer reports one per call)."""
        algorithm = f"chunked(c={self.chunk})" if self.algorithm == "chunked" else self.algorithm
        return f"{algorithm} [{self.kernel}]"


def choose(
    algorithm: str, *, n: int, d: int, batch: int, width: int | None, device: str, dtype: torch.dtype,
    shared_limit: int | None = None,
) -> Plan:  # fmt: skip
    """The plan of one scan of ``n`` steps over ``batch`` rows of a ``d``-state.

    Args:
        algorithm: one of :data:`ALGORITHMS`.
        width: the factored weight's rows ``m`` (``FactoredJacobians``), ``None`` for dense Jacobians.
        device: the device type (``"cpu"``, ``"cuda"``, ...).
        dtype: the inputs' dtype (half precision computes in float32).
        shared_limit: CUDA only: the shared memory a block may use on the device the scan runs on (``None``:
            torch's current device's, :func:`lightning_bppsa.kernels.cuda.current_shared_limit`).
    """
    check_algorithm(algorithm)
    if device == "cuda" and shared_limit is None and cuda_kernel.available()[0]:
        shared_limit = cuda_kernel.current_shared_limit()
    key = (algorithm, n, d, batch, width, device, compute_dtype(dtype), shared_limit)
    if torch.compiler.is_compiling():  # kernels report only what eager calls found: never cache that
        return _choose.__wrapped__(*key)
    return _choose(*key)


@lru_cache(maxsize=4096)  # called on every scan; shapes repeat from batch to batch
def _choose(
    algorithm: str, n: int, d: int, batch: int, width: int | None, device: str, dtype: torch.dtype,
    shared_limit: int | None,
) -> Plan:  # fmt: skip
    element_bytes = torch.finfo(dtype).bits // 8
    if device == "cuda":
        ok, reason = cuda_kernel.available()
        if ok:
            why = cuda_kernel.refusal("linear", d=d, element_bytes=element_bytes, shared_limit=shared_limit)
            ok, reason = why is None, why
        if ok:
            return _cuda_plan(algorithm, n=n, d=d, batch=batch, width=width, element_bytes=element_bytes,
                              shared_limit=shared_limit)  # fmt: skip
        kernel, why = "torch", f"torch implementation on CUDA: {reason}"
    elif device == "cpu" and cpu_kernel.available() and dtype in (torch.float32, torch.float64):
        kernel, why = "c", "compiled C sweeps"
    else:
        kernel, why = "torch", "torch implementation" + (" (no C kernel)" if device == "cpu" else "")
    native = kernel == "c"
    chunk = cost_model.best_chunk(n=n, d=d, batch=batch, width=width, device=device, native=native)
    if algorithm != "auto":
        return Plan(kernel, algorithm, chunk, f"{why}; {algorithm} as asked")
    name = cost_model.fastest(n=n, d=d, batch=batch, width=width, device=device, native=native, chunk=chunk)
    return Plan(kernel, name, chunk, f"{why}; {name} predicted fastest by cost_model")


def _cuda_plan(
    algorithm: str, *, n: int, d: int, batch: int, width: int | None, element_bytes: int, shared_limit: int
) -> Plan:
    """The CUDA kernels' plan where they load and the sweep fits: the chunked kernel only where the device
    can launch it (:func:`~lightning_bppsa.kernels.cuda.refusal`, asked with a per-step gradient: the larger
    need), else the sweep, said in the plan."""
    chunked_why = None
    if algorithm != "linear" and n > 1:
        chunked_why = cuda_kernel.refusal(
            "chunked", d=d, element_bytes=element_bytes, shared_limit=shared_limit
        )
    if chunked_why is not None:
        if algorithm == "auto":
            return Plan("cuda", "linear", 1, f"CUDA kernels: the sweep, the only launch here ({chunked_why})")
        return Plan("cuda", "linear", 1, f"CUDA kernels: {algorithm} asked, but {chunked_why}: the sweep",
                    instead=f"{algorithm} asked: {chunked_why}")  # fmt: skip
    name, chunk = cuda_choose(algorithm, n=n, d=d, batch=batch, width=width, element_bytes=element_bytes)
    # the model's own limit (an H100's shared memory) may refuse what this device can launch
    if algorithm in ("chunked", "blelloch") and name == "linear" and n > 1:
        why = f"the calibrated model (an H100's shared memory) has no chunked launch of d={d}"
        return Plan("cuda", "linear", 1, f"CUDA kernels: {algorithm} asked, but {why}: the sweep",
                    instead=f"{algorithm} asked: {why}")  # fmt: skip
    return Plan("cuda", name, chunk, "CUDA kernels, calibrated model of cuda_step_model")
