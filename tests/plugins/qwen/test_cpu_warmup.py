"""The CPU warm-up steps (``executor_options.cpu_warmup``, pypto_serving_qwen.warmup): what they lay
out in the caches (checked against an enumeration of every slot), that they really run a prefill
and two decode steps of the most rows (the native decoder among them), and that nothing of them
shows afterwards: the caches zeroed, the step counters at zero, the next steps' logits bitwise those
of an executor that never warmed up."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import pypto_kernels as K
from pypto_serving_qwen.executor import QwenExecutor
from pypto_serving_qwen.warmup import warmup_batches, warmup_plan
from tests.plugins.qwen.qwen_fixtures import PagedBatchBuilder, qwen_settings, scheduled_chunks


@pytest.mark.parametrize("num_blocks", [1, 2, 3, 7, 64, 200])
@pytest.mark.parametrize("block_size", [1, 2, 4, 16])
@pytest.mark.parametrize(("max_tokens", "max_rows"), [(8, 4), (128, 64), (2048, 64), (3, 5)])
def test_plan_fits_the_caches_and_batches_write_distinct_slots(
    num_blocks: int, block_size: int, max_tokens: int, max_rows: int
) -> None:
    plan = warmup_plan(num_blocks, block_size, max_tokens, max_rows)
    requests = min(num_blocks, max_rows)
    if (num_blocks // requests) * block_size < 3:  # a request's blocks cannot hold a token and two more
        assert plan is None
        return
    assert plan is not None and plan.requests == requests and plan.used_blocks <= num_blocks
    assert plan.prompt + 2 <= plan.blocks * block_size
    assert plan.requests * plan.prompt <= max(max_tokens, plan.requests)
    steps = warmup_batches(plan, block_size, vocab_size=50, group="kv")
    assert [b.query_start_loc_host[-1] for b in steps] == [plan.requests * plan.prompt, plan.requests, plan.requests]
    # Every (request, position) written, by enumeration: request i's position t lies in its own
    # blocks i * blocks .. at slot block * block_size + t % block_size.
    expected = {
        (i * plan.blocks + t // block_size) * block_size + t % block_size
        for i in range(plan.requests)
        for t in range(plan.prompt + 2)
    }
    written = [s for b in steps for s in b.slot_mapping["kv"].tolist()]
    assert len(written) == len(set(written)) and set(written) == expected
    assert all(s < plan.used_blocks * block_size for s in written)
    for b in steps:
        assert b.seq_lens_host == [int(b.positions.max()) + 1] * plan.requests
        assert b.logits_indices.tolist() == [q - 1 for q in b.query_start_loc_host[1:]]
        assert int(b.input_ids.max()) < 50


def _executor(path: Path, warm: bool, dtype: str = "float32") -> QwenExecutor:
    # The native panels where the kernels are built, so the decode steps take the native decoder.
    options = {"cpu_linear": "panels"} if K.native.library() is not None else {}
    settings = qwen_settings(
        path, dtype=dtype, max_num_seqs=6, max_num_batched_tokens=64, executor_options={"cpu_warmup": warm, **options}
    )
    ex = QwenExecutor(settings)
    ex.load()
    return ex


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_warm_up_runs_its_steps_and_leaves_no_trace(
    dtype: str, qwen_checkpoints: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = qwen_checkpoints("qwen3")
    warm, cold = _executor(path, True, dtype), _executor(path, False, dtype)
    rows: list[int] = []
    execute = QwenExecutor.execute

    def spy(self: QwenExecutor, batch: Any) -> torch.Tensor:
        rows.append(len(batch.input_ids))
        return execute(self, batch)

    monkeypatch.setattr(QwenExecutor, "execute", spy)
    warm.init_kv_cache({"kv": 64})
    # 64 blocks of 4 slots over 6 requests: 10 blocks each; a 12-token prefill (2 x 6), two decodes.
    assert rows == [12, 6, 6]
    cold.init_kv_cache({"kv": 64})
    assert rows == [12, 6, 6]  # the cold executor ran none
    monkeypatch.undo()
    assert warm.eager_steps == 0 and warm.graph_stats.native_decoder_steps == 0
    assert all(not t.any() for pair in warm.kv_caches for t in pair)  # the written blocks zeroed again
    if K.native.library() is not None:  # the decode steps took the native decoder, made over these caches
        assert warm.model is not None and warm.model._native is not None
        assert warm.model._native[0] is warm.kv_caches and warm.model._native[1] is not None
    warm_builder, cold_builder = PagedBatchBuilder(4, 64), PagedBatchBuilder(4, 64)
    gen = torch.Generator().manual_seed(5)
    prompts = {rid: torch.randint(4, 300, (n,), generator=gen).tolist() for rid, n in zip("abc", (9, 21, 4))}
    schedule = [[("a", 9), ("b", 21)], [("a", 1), ("b", 1), ("c", 4)]] + [[("a", 1), ("b", 1), ("c", 1)]] * 3
    for step, chunks in enumerate(scheduled_chunks(prompts, schedule, gen)):
        ours, theirs = warm.execute(warm_builder.step(chunks)), cold.execute(cold_builder.step(chunks))
        assert torch.equal(ours, theirs), f"step {step}"
    assert warm.eager_steps == cold.eager_steps == len(schedule)


def test_warm_up_option_is_checked(qwen_checkpoints: Callable[[str], Path]) -> None:
    with pytest.raises(ValueError, match="cpu_warmup must be true or false"):
        _executor(qwen_checkpoints("qwen3"), "yes")  # type: ignore[arg-type]
    ex = _executor(qwen_checkpoints("qwen3"), True)
    ex.init_kv_cache({"kv": 2})  # 2 blocks of 4 slots for 2 requests: a token and two more fit
    assert ex.eager_steps == 0 and all(not t.any() for pair in ex.kv_caches for t in pair)
