"""Main-model parity with transformers' DeepseekV4ForCausalLM through the paged executor."""

from __future__ import annotations

import pytest
import torch

from .helpers import FakeCore, greedy_generate, make_executor

ATOL = 2e-4
PROMPT_LEN = 21  # several CSA/HCA windows, past the sliding window, not window-aligned


def _prompt(seed: int, n: int = PROMPT_LEN, vocab: int = 96) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_logits(ckpt, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ckpt.hf(torch.tensor([ids])).logits[0].float()


def _run_chunks(core: FakeCore, rid: str, ids: list[int], chunks: list[int]) -> torch.Tensor:
    rows, start = [], 0
    for size in chunks:
        toks = ids[start : start + size]
        rows.append(core.ex.execute(core.batch([(rid, toks, start, len(toks))])))
        start += size
    return torch.cat(rows)


@pytest.mark.parametrize("variant", ["mixed_yarn", "csa_heavy", "sliding_only"])
def test_prefill_matches_transformers(checkpoints, variant):
    ckpt = checkpoints[variant]
    ex, _ = make_executor(ckpt.path)
    core = FakeCore(ex, _)
    ids = _prompt(1)
    ours = _run_chunks(core, "a", ids, [len(ids)])
    torch.testing.assert_close(ours, _hf_logits(ckpt, ids), atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("variant", ["mixed_yarn", "csa_heavy"])
@pytest.mark.parametrize("chunks", [[5, 7, 9], [1, 3, 4, 13], [8, 8, 5]])
def test_chunked_prefill_equals_unchunked(checkpoints, variant, chunks):
    ckpt = checkpoints[variant]
    ex, info = make_executor(ckpt.path)
    core = FakeCore(ex, info)
    ids = _prompt(2)
    ours = _run_chunks(core, "a", ids, chunks)
    torch.testing.assert_close(ours, _hf_logits(ckpt, ids), atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("variant", ["mixed_yarn", "csa_heavy"])
def test_incremental_decode_equals_full_forward(checkpoints, variant):
    ckpt = checkpoints[variant]
    ex, info = make_executor(ckpt.path)
    core = FakeCore(ex, info)
    ids = _prompt(3, 24)
    ours = _run_chunks(core, "a", ids, [6] + [1] * 18)
    torch.testing.assert_close(ours, _hf_logits(ckpt, ids), atol=ATOL, rtol=1e-4)


def test_mixed_batch_of_requests(checkpoints):
    """Two requests in one flat batch (one prefilling, one decoding) match their solo runs."""
    ckpt = checkpoints["mixed_yarn"]
    ex, info = make_executor(ckpt.path)
    core = FakeCore(ex, info)
    a, b = _prompt(4), _prompt(5, 13)
    first = ex.execute(core.batch([("a", a[:10], 0, 10)]))
    both = ex.execute(core.batch([("a", a[10:], 10, len(a) - 10), ("b", b, 0, len(b))]))
    torch.testing.assert_close(torch.cat([first, both[: len(a) - 10]]), _hf_logits(ckpt, a), atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(both[len(a) - 10 :], _hf_logits(ckpt, b), atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("variant", ["mixed_yarn", "csa_heavy"])
def test_decodes_around_a_prefill(checkpoints, variant):
    """Decodes on both sides of a prefill attend as one group whose rows are not consecutive, with
    keys of different lengths; each request still matches transformers."""
    ckpt = checkpoints[variant]
    ex, info = make_executor(ckpt.path)
    core = FakeCore(ex, info)
    a, b, c = _prompt(6, 23), _prompt(7, 9), _prompt(8, 12)
    ex.execute(core.batch([("a", a[:-1], 0, 1), ("b", b[:-1], 0, 1)]))
    out = ex.execute(core.batch([("a", a[-1:], len(a) - 1, 1), ("c", c, 0, len(c)), ("b", b[-1:], len(b) - 1, 1)]))
    torch.testing.assert_close(out[0], _hf_logits(ckpt, a)[-1], atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(out[1:-1], _hf_logits(ckpt, c), atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(out[-1], _hf_logits(ckpt, b)[-1], atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("variant", ["mixed_yarn", "csa_heavy"])
def test_greedy_generation_matches_transformers(checkpoints, variant):
    ckpt = checkpoints[variant]
    prompt = _prompt(6, 9)
    with torch.no_grad():
        ref = ckpt.hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt) :].tolist()
    ex, info = make_executor(ckpt.path)
    out = greedy_generate(FakeCore(ex, info), {"a": prompt}, 24, chunk=4)
    assert out["a"] == ref
