"""Batched compressor emission and MTP drafting: several requests at different positions in one step
(prefill chunks next to decodes and draft verifications, windows closing mid-step, a request starting
from position 0) against transformers, the full-recompute draft reference, and a hand-written pooling."""

from __future__ import annotations

import random

import pytest
import torch

from pypto_kernels import compressor_pool
from pypto_serving_deepseek_mtp.emission import EmitShape, build_emit_plan

from .helpers import FakeCore, greedy_generate, make_executor
from .test_mtp import reference_drafts

ATOL = 2e-4


def _seq(seed: int, n: int) -> list[int]:
    return torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_logits(ckpt, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ckpt.hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("variant", ["mixed_yarn", "csa_heavy"])  # rates 2/4 and 4/8
@pytest.mark.parametrize("k", [0, 2])
def test_one_step_of_many_requests_matches_transformers(checkpoints, variant, k):
    """Step 2 holds a decode and a 3-row verification whose windows close in that step, a long
    prefill chunk spanning several windows, and a short prefill from position 0 (window 0 of its CSA
    layers has no previous window); step 3 decodes them all. Every row's logits match transformers
    on that request alone."""
    ckpt = checkpoints[variant]
    ex, info = make_executor(ckpt.path, k=k)
    core = FakeCore(ex, info)
    seqs = {r: _seq(i + 20, 30) for i, r in enumerate("abcd")}
    steps = [
        [("a", 0, 15), ("b", 0, 13), ("c", 0, 6)],
        [("a", 15, 16), ("b", 13, 16), ("c", 6, 23), ("d", 0, 5)],
        [("a", 16, 17), ("c", 23, 24), ("b", 16, 18), ("d", 5, 6)],
    ]
    got: dict[str, list[torch.Tensor]] = {r: [] for r in seqs}
    for step in steps:
        batch = core.batch([(r, seqs[r][lo:hi], lo, hi - lo) for r, lo, hi in step])
        logits = ex.execute(batch)
        row = 0
        for r, lo, hi in step:
            got[r].append(logits[row : row + hi - lo])
            row += hi - lo
    for r, parts in got.items():
        ours = torch.cat(parts)
        torch.testing.assert_close(ours, _hf_logits(ckpt, seqs[r][: ours.shape[0]]), atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize(("variant", "k"), [("csa_heavy", 2), ("mixed_yarn", 3)])
def test_drafts_of_many_requests_match_full_recompute(checkpoints, variant, k):
    """Four requests of different lengths, chunked prefill (non-sampling chunks leave inputs in the
    carry rings for the next step) and random forced acceptance: every request's drafts in every
    step equal the full-recompute reference."""
    ckpt = checkpoints[variant]
    ex, info = make_executor(ckpt.path, k=k)
    rng = random.Random(11)
    checked: list[str] = []

    def check(batch, histories, drafts):
        for rid, dr in zip(batch.request_ids, drafts):
            if dr:
                assert dr == reference_drafts(ckpt, histories[rid], k), (rid, len(histories[rid]))
                checked.append(rid)

    prompts = {"a": _seq(1, 13), "b": _seq(2, 4), "c": _seq(3, 9), "d": _seq(4, 2)}
    greedy_generate(FakeCore(ex, info), prompts, 10, k=k, chunk=3, on_step=check, accept=lambda n: rng.randint(0, n))
    assert set(checked) == set(prompts) and len(checked) >= 15


def _pool_by_hand(
    kv: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, m: int, w: int, overlap: bool
) -> torch.Tensor:
    """Entry ``w`` of one request's full source rows, written out slot by slot."""
    width = kv.shape[1]
    hd = width // 2 if overlap else width
    slots: list[tuple[torch.Tensor, torch.Tensor]] = []
    for i in range(m):
        if overlap and w > 0:
            slots.append((kv[(w - 1) * m + i, :hd], gate[(w - 1) * m + i, :hd] + bias[i, :hd]))
    for i in range(m):
        src = slice(hd, None) if overlap else slice(None)
        slots.append((kv[w * m + i, src], gate[w * m + i, src] + bias[i, src]))
    weights = torch.softmax(torch.stack([g for _, g in slots]), dim=0)
    return (weights * torch.stack([v for v, _ in slots])).sum(dim=0)


@pytest.mark.parametrize(("m", "overlap"), [(2, True), (4, True), (4, False), (8, False)])
def test_emission_plan_gathers_ring_and_batch_rows(m, overlap):
    """Requests with sources split between the ring (earlier steps, wrapped) and this step's rows:
    the plan's gather plus compressor_pool equals pooling each entry by hand from the full sequence."""
    gen = torch.Generator().manual_seed(m)
    width, ring_len, num_slots = 6, 2 * m + 3, 4
    # (pos0, rows this step, ring slot): decodes closing a window, a multi-row step across two
    # windows, a request starting at 0, one with no rows, one well past the ring's length.
    reqs = [(m - 1, 1, 2), (2 * m - 2, m + 3, 0), (0, m + 1, 3), (5, 0, 1), (7 * m + 1, 2 * m, 1)]
    full = [(torch.randn(p0 + n, width, generator=gen), torch.randn(p0 + n, width, generator=gen)) for p0, n, _ in reqs]
    bias = torch.randn(m, width, generator=gen)
    ring_kv = torch.full((num_slots * ring_len, width), float("nan"))
    ring_gate = torch.full((num_slots * ring_len, width), float("nan"))
    starts, batch_kv, batch_gate = [0], [], []
    for (p0, n, slot), (kv, gate) in zip(reqs, full):
        for pos in range(max(0, p0 - ring_len), p0):
            ring_kv[slot * ring_len + pos % ring_len] = kv[pos]
            ring_gate[slot * ring_len + pos % ring_len] = gate[pos]
        batch_kv.append(kv[p0:])
        batch_gate.append(gate[p0:])
        starts.append(starts[-1] + n)
    shape = EmitShape(rate=m, overlap=overlap, ring_len=ring_len, ring_rows=num_slots * ring_len)
    plan = build_emit_plan(shape, starts, [p0 for p0, _, _ in reqs], [s for _, _, s in reqs], torch.device("cpu"))
    assert plan.entries is not None
    src_kv = plan.entries.gather(torch.cat([ring_kv, *batch_kv]), 0.0)
    src_gate = plan.entries.gather(torch.cat([ring_gate, *batch_gate]), float("-inf"))
    pooled = compressor_pool(src_kv, src_gate, bias, m, 1 if overlap else 0, overlap)
    expected = [
        _pool_by_hand(kv, gate, bias, m, w, overlap)
        for (p0, n, _), (kv, gate) in zip(reqs, full)
        for w in range(p0 // m, (p0 + n) // m)
    ]
    assert plan.entries.w.tolist() == [w for p0, n, _ in reqs for w in range(p0 // m, (p0 + n) // m)]
    torch.testing.assert_close(pooled, torch.stack(expected), atol=1e-5, rtol=1e-5)
    # The ring keeps each request's last ring_len rows of this step, at their own positions.
    rows = list(range(starts[-1])) if plan.ring_src is None else plan.ring_src.tolist()
    want = [
        (starts[r] + pos - p0, slot * ring_len + pos % ring_len)
        for r, (p0, n, slot) in enumerate(reqs)
        for pos in range(max(p0, p0 + n - ring_len), p0 + n)
    ]
    assert list(zip(rows, plan.ring_dst.tolist())) == want
