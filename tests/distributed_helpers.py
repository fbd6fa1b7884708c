"""Running a function on several gloo ranks from a test: each rank is a spawned process with
torch.distributed's default process group initialised over loopback (a free port found by binding
port 0), and the function's return values come back to the test in rank order."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["free_port", "run_ranks"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it for port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _rank_main(
    rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...], results: Any
) -> None:
    torch.set_num_threads(1)  # every rank shares the machine's few cores
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        try:
            # Plain pickle bytes: tensors then travel by value, not as shared memory the rank's exit frees.
            results.put((rank, True, pickle.dumps(fn(*args))))
        finally:
            dist.destroy_process_group()
    except BaseException:  # the test reports the rank's traceback
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0) -> list[Any]:
    """``[fn(*args) on rank 0, ..., on rank world_size - 1]``, each in its own process group member.

    ``fn`` must be a module-level function (it is pickled by reference) and return picklable values.

    :raises RuntimeError: a rank raised (its traceback is in the message) or did not finish in time.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, port, fn, args, results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            rank, ok, value = results.get(timeout=timeout)
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            got[rank] = pickle.loads(value)
    except queue.Empty:
        raise RuntimeError(f"ranks {sorted(set(range(world_size)) - set(got))} did not finish in {timeout} s") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [got[r] for r in range(world_size)]
