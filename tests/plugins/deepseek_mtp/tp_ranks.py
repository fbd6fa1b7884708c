"""Spawned tensor-parallel ranks for the DeepSeek-V4 tests: each rank joins a gloo process group,
runs the same scenarios through its own executor and saves what it saw (logits, greedy tokens,
MTP drafts, its weights' sizes) for the parent test to compare with a single-rank run."""

from __future__ import annotations

import multiprocessing as mp
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

PROMPTS = {"a": [5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 12], "b": [7, 7, 19, 54, 23], "c": list(range(20, 38))}
MAX_NEW = 8


@dataclass(frozen=True, slots=True)
class Scenario:
    """One executor run: checkpoint, MTP depth k, expert parallel or not, prefill chunk size."""

    path: str
    k: int = 2
    expert_parallel: bool = False
    chunk: int = 0
    prompts: dict[str, list[int]] = field(default_factory=lambda: PROMPTS)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(sc: Scenario, world_size: int = 1) -> dict[str, Any]:
    """Greedy generation with MTP drafting through the executor (helpers.FakeCore drives it); returns
    every step's logits, the tokens, every step's drafts and the loaded weights' element count."""
    from pypto_serving.config import ServingSettings
    from pypto_serving_deepseek_mtp import DeepseekMTPExecutor

    from .helpers import FakeCore, greedy_generate

    spec = {"method": "mtp", "num_speculative_tokens": sc.k} if sc.k else None
    settings = ServingSettings(
        model=sc.path,
        dtype="float32",
        device="cpu",
        block_size=4,
        speculative_config=spec,
        max_num_seqs=4,
        tensor_parallel_size=world_size,
        enable_expert_parallel=sc.expert_parallel,
    )
    ex = DeepseekMTPExecutor(settings)
    info = ex.load()
    elements = _elements(ex)
    torch.manual_seed(0)  # FakeCore hands out blocks in a random order: the same one on every rank
    core = FakeCore(ex, info)
    logits: list[torch.Tensor] = []
    drafts: list[list[list[int]]] = []
    execute = ex.execute

    def spy(batch: Any) -> torch.Tensor:
        out: torch.Tensor = execute(batch)
        logits.append(out.clone())
        return out

    ex.execute = spy
    tokens = greedy_generate(
        core, sc.prompts, MAX_NEW, k=sc.k, chunk=sc.chunk, on_step=lambda _b, _h, new: drafts.append(new)
    )
    return {"logits": logits, "tokens": tokens, "drafts": drafts, "elements": elements}


def _elements(ex: Any) -> int:
    m = ex.model
    tensors = [m.embed, m.head, m.norm, *m.hc_head]
    tensors += [t for p in [*m.layers, *ex.mtp_layers] for t in p.values()]
    # A weight kept in its stored precision counts the values it stands for (MXFP4: two a byte).
    values = {
        id(t): t.data.numel() * (2 if t.scheme == "mxfp4" else 1) if hasattr(t, "scheme") else t.numel()
        for t in tensors
    }
    return sum(values.values())


def _rank_main(rank: int, world_size: int, port: int, scenarios: list[Scenario], out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        results = [run(sc, world_size) for sc in scenarios]
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_ranks(
    scenarios: list[Scenario], out_dir: Path, world_size: int = 2, timeout: float = 120.0
) -> list[list[dict[str, Any]]]:
    """Every scenario on ``world_size`` spawned ranks of one process group; per rank, its results."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, port, scenarios, str(out_dir))) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
    codes = [p.exitcode for p in procs]
    if codes != [0] * world_size:
        raise RuntimeError(f"tensor-parallel ranks exited with {codes}")
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world_size)]
