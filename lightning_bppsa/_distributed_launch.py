"""Run a function on ``p`` local CPU processes joined in one gloo process group (tests, benchmarks).

The function is found in the child by its file and name, so it may live in a test file or a script
that is not importable as a module (pytest's importlib mode, ``python benchmarks/x.py``).
"""

from __future__ import annotations

import datetime
import importlib.util
import inspect
import os
import socket
from collections.abc import Callable

import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["spawn"]


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
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )
    try:
        _load(path, name)(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn(target: Callable, world: int, *args: object, timeout_s: float = 60.0) -> None:
    """Run ``target(rank, world, *args)`` on ``world`` new processes sharing one gloo group.

    Args:
        target: a module-level function (looked up again by file and name in each child).
        world: number of processes ``p``.
        args: picklable extra arguments.
        timeout_s: the process group's timeout (collectives and point-to-point receives).

    Raises:
        torch.multiprocessing.ProcessRaisedException: a child raised; its traceback is in the message.
    """
    path, name = inspect.getfile(target), target.__name__
    mp.spawn(_entry, args=(world, _free_port(), timeout_s, path, name, args), nprocs=world, join=True)
