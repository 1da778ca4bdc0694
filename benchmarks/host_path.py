"""Where a recurrent layer's training step spends its host time: the ``host`` stage of ``benchmarks/gpu.py``.

Issue 29: on an H100 the scan's step took 1.5-1.7 ms eager where its kernels take ~0.45 ms, so the host path
(Python, allocations, launches, any hidden synchronisation) bounds it. Per workload, torch's module (cuDNN)
and ours with the scan forced (``algorithm`` given), each step as in ``cuda-step.md``:

- step ms: each step waited for (CUDA events), as every table of the command;
- host ms: the CPU time to queue one step (``time.perf_counter`` around the call, the GPU waited for
  outside it): equal to the step where the host path bounds it, the GPU's share where a call synchronises;
- back-to-back ms: 20 steps queued with one wait at the end, per step (the host and the GPU overlapping);
- graphed ms: the same step captured once in a CUDA graph and replayed (the GPU's work alone);
- syncs: the synchronising calls torch reports in one step (``torch.cuda.set_sync_debug_mode``);
- kernels and GPU-busy us per step (``torch.profiler``, 5 steps);
- then, for ours, the profiler's self-CPU table and ``cProfile``'s top functions by own time.

On the CPU (``--device cpu --tiny``) the rows that need CUDA say so; the rest run as a smoke test.
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import pstats
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from unittest import mock

import torch
from device_runner import NO_CUDA, SKIPPED, Runner, header, markdown_table, ms_text, train_step, write
from torch import nn

#: (cell, B, T, input, H, the algorithm forced on ours)
HostWorkload = tuple[str, int, int, int, int, str]
HOST_COLUMNS = (
    "module", "cell", "B", "T", "in", "H", "step ms", "host ms", "back-to-back ms", "graphed ms", "syncs",
    "kernels/step", "GPU busy us/step", "plan",
)  # fmt: skip
#: timed calls per quantity (the medians of these)
CALLS = 15
#: steps queued back to back, one wait at the end
BACK_TO_BACK = 20
PROFILED_STEPS = 5


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _host_seconds(fn: Callable[[], None], device: str) -> float:
    """Median CPU seconds to queue one call (the device waited for between calls, outside the timing)."""
    times = []
    for _ in range(CALLS):
        _sync(device)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    _sync(device)
    return statistics.median(times)


def _step_seconds(runner: Runner, fn: Callable[[], None]) -> float:
    return statistics.median(runner.call_seconds(fn, CALLS))


def _back_to_back_seconds(fn: Callable[[], None], device: str) -> float:
    _sync(device)
    start = time.perf_counter()
    for _ in range(BACK_TO_BACK):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / BACK_TO_BACK


def graphed_seconds(module: nn.Module, x: torch.Tensor) -> float | str:
    """Seconds per replay of the whole step captured in one CUDA graph, or why it could not be captured."""
    step = train_step(module, x, set_to_none=False)
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    except Exception as err:  # noqa: BLE001  (any capture failure is a finding to write down)
        torch.cuda.synchronize()
        return f"not captured ({type(err).__name__}: {str(err).splitlines()[0][:120]})"
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(CALLS):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / CALLS


def _syncs(fn: Callable[[], None]) -> str:
    """The synchronising calls torch reports during one call (their count and the first one's message)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    found = [str(w.message).splitlines()[0][:80] for w in caught if "synchroniz" in str(w.message).lower()]
    return f"{len(found)}" + (f" ({found[0]})" if found else "")


def _profile(fn: Callable[[], None]) -> tuple[float, float, str]:
    """(kernels per step, GPU-busy microseconds per step, the profiler's top self-CPU table) over a few steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_STEPS):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in kernels)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60)
    return len(kernels) / PROFILED_STEPS, busy / PROFILED_STEPS, table


def python_profile(fn: Callable[[], None], device: str) -> str:
    """cProfile's 25 functions of most own time over :data:`BACK_TO_BACK` calls (the device not waited for)."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(BACK_TO_BACK):
        fn()
    profiler.disable()
    _sync(device)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    return text.getvalue()


#: the row of an "auto" module made sure of the scan, whose steps replay from CUDA graphs (lightning_bppsa.nn._replay)
REPLAYED = "BPPSA auto, replayed"


def _modules(workload: HostWorkload, device: str) -> tuple[dict[str, nn.Module], torch.Tensor]:
    from lightning_bppsa import nn as bnn

    cell, batch, length, inputs, hidden, algorithm = workload
    torch.manual_seed(0)
    ref = getattr(nn, cell)(inputs, hidden, batch_first=True).to(device)
    modules = {"cuDNN" if device == "cuda" else "torch": ref}
    for name, asked in ((f"BPPSA {algorithm}", algorithm), (REPLAYED, "auto")):
        modules[name] = getattr(bnn, cell)(inputs, hidden, batch_first=True, algorithm=asked).to(device)
        modules[name].load_state_dict(ref.state_dict())
    x = torch.randn(batch, length, inputs, device=device)
    return modules, x


@contextlib.contextmanager
def scan_decided() -> Iterator[None]:
    """"auto" made sure of the scan (its model patched) inside, the decisions forgotten before and after (no
    other measurement may read a decision made so): the replayed rows here and in ``host_proxy.py``."""
    from lightning_bppsa import layer_plan
    from lightning_bppsa.nn import recurrent

    layer_plan.forget()
    try:
        with mock.patch.object(recurrent, "_predict", lambda shape: (1e-3, 1e-2)):
            yield
    finally:
        layer_plan.forget()


def host_row(runner: Runner, workload: HostWorkload) -> tuple[list[list[str]], str]:
    """The table's rows of one workload (torch's module, ours forced, ours replayed) and the profiles of ours,
    as text."""
    modules, x = _modules(workload, runner.device)
    rows, details = [], ""
    for name, module in modules.items():
        with scan_decided() if name == REPLAYED else contextlib.nullcontext():
            row, table, step = _host_columns(runner, workload, name, module, x)
            rows.append(row)
            if name.startswith("BPPSA"):
                title = f"{name}, {workload[0]} B={workload[1]} T={workload[2]} in={workload[3]} H={workload[4]}"
                details += f"\n## {title}\n\ntorch.profiler, {PROFILED_STEPS} steps:\n\n```\n{table}```\n"
                details += f"\ncProfile, {BACK_TO_BACK} steps:\n\n```\n{python_profile(step, runner.device)}```\n"
    return rows, details


def _host_columns(
    runner: Runner, workload: HostWorkload, name: str, module: nn.Module, x: torch.Tensor
) -> tuple[list[str], str, Callable[[], None]]:
    """``module``'s row of the host table, its profiler table (CUDA) and its step."""
    step = train_step(module, x)
    for _ in range(3):
        step()  # warm-up: kernels compiled, plans made (and a replayed step's graphs captured)
    cuda = runner.device == "cuda"
    graphed = graphed_seconds(module, x) if cuda else NO_CUDA
    kernels, busy, table = _profile(step) if cuda else (NO_CUDA, NO_CUDA, "")
    plan = getattr(module, "last_stats", {}).get("plan", "torch's layer")
    row = [
        name, *map(str, workload[:5]), ms_text(_step_seconds(runner, step)),
        ms_text(_host_seconds(step, runner.device)), ms_text(_back_to_back_seconds(step, runner.device)),
        ms_text(graphed), _syncs(step) if cuda else NO_CUDA,
        kernels if isinstance(kernels, str) else f"{kernels:.0f}",
        busy if isinstance(busy, str) else f"{busy:.0f}", plan,
    ]  # fmt: skip
    return row, table, step


def host_stage(runner: Runner) -> list[list[str]]:
    """:func:`host_row` of every workload of ``shapes.host`` before the deadline; ``cuda-host.md`` after each."""
    workloads = runner.shapes.host
    done: list[list[str]] = []
    details = ""
    for workload in workloads:
        if runner.left() <= 0:
            rows = [[SKIPPED, *map(str, workload[:5]), *[SKIPPED] * (len(HOST_COLUMNS) - 6)]]
        else:
            rows, more = host_row(runner, workload)
            details += more
        done += rows
        for row in rows:
            print("host " + " | ".join(row), flush=True)
        write(runner, "cuda-host.md", header(runner, "The host path of one training step") + (
            "Per workload, torch's module, lightning_bppsa's with the scan forced, and an \"auto\" one made sure of the "
            "scan (its model patched), whose steps replay from CUDA graphs from the second on; step = zero the gradients, "
            "forward, loss = sum of the last output step, backward, float32. step ms: each step waited for "
            f"({runner.timer}); host ms: CPU time to queue one step; back-to-back ms: {BACK_TO_BACK} steps "
            "queued, one wait, per step; graphed ms: the step captured in one CUDA graph, per replay; syncs: "
            "synchronising calls torch reports in one step; kernels and GPU busy: torch.profiler over "
            f"{PROFILED_STEPS} steps. Medians of {CALLS} calls.\n\n"
            + markdown_table(HOST_COLUMNS, done) + details
        ))  # fmt: skip
    return done
