"""Run a function on ``p`` local CPU processes joined in one gloo process group (tests, benchmarks).

:func:`spawn_gloo` starts ``p`` processes on this machine (127.0.0.1, a free port), initialises the
default process group with the gloo backend in each, and calls ``target(rank, world, *args)``. The
children look like processes started by ``torchrun`` (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` are set), so a Lightning ``Trainer`` built in
``target`` with ``devices=p`` joins the existing group instead of launching processes of its own.

The function is found in the child by its file and name, so it may live in a test file or a script
that is not importable as a module (pytest's importlib mode, ``python benchmarks/x.py``).

Example (in a file, with a module-level function)::

    def check(rank, world, size):
        t = torch.full((size,), float(rank))
        torch.distributed.all_reduce(t)
        assert t.tolist() == [world * (world - 1) / 2] * size

    spawn_gloo(check, 2, 3)
"""

from __future__ import annotations

import datetime
import importlib.util
import inspect
import os
import socket
import sys
import time
from collections.abc import Callable

import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_bppsa.kernels import cpu as cpu_kernel
from lightning_bppsa.kernels import recurrent as cell_kernels

__all__ = ["spawn_gloo"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load(path: str, name: str) -> Callable:
    spec = importlib.util.spec_from_file_location(f"_bppsa_spawned_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def _entry(rank: int, world: int, port: int, timeout_s: float, path: str, name: str, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )
    try:
        _load(path, name)(rank, world, *args)
    finally:
        dist.destroy_process_group()
    # The work succeeded: leave without the interpreter's teardown, where a torch / gloo thread still
    # joinable was seen to abort a child ("terminate called without an active exception", SIGABRT) after
    # everything it had to do was done and checked.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_gloo(
    target: Callable,
    world: int,
    *args: object,
    timeout_s: float = 60.0,
    wall_limit_s: float = 600.0,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Run ``target(rank, world, *args)`` on ``world`` new processes sharing one gloo group; wait for all.

    A child whose ``target`` returned leaves the group and exits at once (``os._exit(0)``, after flushing
    stdout and stderr): ``atexit`` handlers do not run there, so ``target`` must close what it writes.

    Args:
        target: a module-level function (looked up again by file and name in each child).
        world: number of processes ``p >= 1``.
        args: picklable extra arguments.
        timeout_s: the process group's timeout (collectives and point-to-point receives).
        wall_limit_s: the longest the whole run may take; past it every child still running is
            terminated and ``TimeoutError`` is raised (a child stuck outside a collective never hangs
            the caller).
        clock: the seconds ``wall_limit_s`` is measured in (tests inject one; waits between its
            readings last at most a second of real time).

    Raises:
        torch.multiprocessing.ProcessRaisedException: a child raised; its traceback is in the message
            (the other children are terminated).
        torch.multiprocessing.ProcessExitedException: a child exited with a non-zero code.
        TimeoutError: the children did not all finish within ``wall_limit_s``.
    """
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be an int >= 1; got {world!r}")
    path, name = inspect.getfile(target), target.__name__
    # Build the compiled CPU kernels here, once, before the children start: children that build them
    # themselves (a cold cache) were seen to abort at exit ("terminate called without an active
    # exception") after finishing their work; loading a cached library does not.
    cpu_kernel.available()
    cell_kernels.available()
    context = mp.spawn(
        _entry, args=(world, _free_port(), timeout_s, path, name, args), nprocs=world, join=False
    )
    deadline = clock() + wall_limit_s
    while not context.join(timeout=max(0.0, min(1.0, deadline - clock()))):
        if clock() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
            for process in context.processes:
                process.join(5)
                if process.is_alive():
                    process.kill()
            raise TimeoutError(
                f"spawn_gloo: {name} on {world} processes did not finish within wall_limit_s={wall_limit_s:g} s"
            )
