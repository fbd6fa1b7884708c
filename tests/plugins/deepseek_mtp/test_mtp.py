"""MTP drafting: cached drafts equal a straightforward full-recompute reference, and speculation
never changes greedy output (rejection, forced acceptance, chunking, preemption, slot reuse)."""

from __future__ import annotations

import random

import pytest
import torch

from .helpers import FakeCore, greedy_generate, make_executor


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@torch.no_grad()
def reference_drafts(ckpt, history: list[int], k: int) -> list[int]:
    """Full recompute, no caches: main model over history[:-1] gives the hyper-connection streams;
    depth d runs its MTP block over every position i with token i + d + 1 (drafts past the end)."""
    hf = ckpt.hf
    cfg = hf.config
    n = len(history) - 1  # position of the last committed token
    ids = torch.tensor([history[:-1]])
    seen: list[torch.Tensor] = []
    handle = hf.model.layers[-1].register_forward_hook(lambda _m, _i, out: seen.append(out))
    try:
        hf.model(ids)
    finally:
        handle.remove()
    hidden = seen[0]  # last decoder layer's streams [1, n, hc, D], before the hyper head
    assert hidden.shape[:3] == (1, n, cfg.hc_mult)
    full = list(history)
    pos = torch.arange(n)[None]
    diff = pos[0][:, None] - pos[0][None, :]
    mask = torch.where((diff >= 0) & (diff < cfg.sliding_window), 0.0, float("-inf"))[None, None]
    for d in range(k):
        m = ckpt.mtp[min(d, len(ckpt.mtp) - 1)]
        one = m["hf"].model
        tok = torch.tensor([full[d + 1 : d + 1 + n]])
        e = _rms(hf.model.embed_tokens(tok), m["enorm.weight"])
        x = e @ m["e_proj.weight"].T
        x = x.unsqueeze(2) + _rms(hidden, m["hnorm.weight"]) @ m["h_proj.weight"].T
        emb = {t: one.rotary_emb(x, position_ids=pos, layer_type=t) for t in ("main", "compress")}
        hidden = one.layers[0](
            x, position_embeddings=emb, position_ids=pos, attention_mask=mask, input_ids=tok, cache=None
        )
        logits = hf.lm_head(one.norm(one.hc_head(hidden)))
        full.append(int(logits[0, -1].argmax()))
    return full[len(history) :]


@pytest.mark.parametrize(("variant", "k"), [("mixed_yarn", 1), ("mixed_yarn", 3), ("csa_heavy", 2)])
def test_drafts_match_full_recompute(checkpoints, variant, k):
    ckpt = checkpoints[variant]
    ex, info = make_executor(ckpt.path, k=k)
    assert info.max_draft_tokens == k
    rng = random.Random(k)
    checked = []

    def check(batch, histories, drafts):
        for rid, dr in zip(batch.request_ids, drafts):
            if dr:
                assert dr == reference_drafts(ckpt, histories[rid], k), (rid, len(histories[rid]))
                checked.append(rid)

    prompts = {"a": _prompt(1, 11), "b": _prompt(2, 6)}
    greedy_generate(FakeCore(ex, info), prompts, 12, k=k, chunk=4, on_step=check, accept=lambda n: rng.randint(0, n))
    assert len(checked) >= 10


@pytest.mark.parametrize("k", [1, 2, 3])
def test_speculation_does_not_change_greedy_output(checkpoints, k):
    ckpt = checkpoints["mixed_yarn"]
    prompts = {"a": _prompt(3, 9), "b": _prompt(4, 14), "c": _prompt(5, 3)}
    base_ex, base_info = make_executor(ckpt.path)
    base = greedy_generate(FakeCore(base_ex, base_info), prompts, 20)
    ex, info = make_executor(ckpt.path, k=k)
    spec = greedy_generate(FakeCore(ex, info), prompts, 20, k=k, chunk=5, preempt_at={"b": 7})
    assert spec == base


def test_a_lowered_drafting_depth_keeps_drafts_exact(checkpoints):
    """A policy's drafting depth caps each request's drafts; a depth a request skipped never comes
    back for it (its KV there is not canonical), while a request starting later takes the depth of
    its first step. The drafts kept are the full-recompute reference's first ones (with forced
    acceptance, so multi-token commits happen), and the greedy output is that of no speculation."""
    ckpt = checkpoints["mixed_yarn"]
    caps = [None, 3, 2, 3, 1, 3, 0, 3]  # per step; 3 after the list
    ex, info = make_executor(ckpt.path, k=3)
    rng = random.Random(11)
    active: dict[str, int] = {}
    lengths: list[int] = []

    def check(batch, histories, drafts):
        cap = 3 if batch.draft_depth is None else batch.draft_depth
        for rid, dr in zip(batch.request_ids, drafts):
            active[rid] = min(active.get(rid, 3), cap)
            if rid in ex.mtp_state and histories[rid][-1:] and dr is not None:
                assert dr == reference_drafts(ckpt, histories[rid], 3)[: len(dr)], rid
                assert len(dr) <= active[rid], (rid, dr, active[rid])
                lengths.append(len(dr))

    prompts = {"a": _prompt(21, 9), "b": _prompt(22, 5)}
    depth = lambda step: caps[step] if step < len(caps) else 3  # noqa: E731
    core = FakeCore(ex, info)
    greedy_generate(core, prompts, 24, k=3, on_step=check, accept=lambda n: rng.randint(0, n), draft_depth=depth)
    assert {1, 2, 3} <= set(lengths) and active == {"a": 0, "b": 0}
    greedy_generate(core, {"c": _prompt(23, 6)}, 6, k=3, on_step=check, draft_depth=lambda step: 2)
    assert active["c"] == 2 and lengths[-1] == 2
    base_ex, base_info = make_executor(ckpt.path)
    base = greedy_generate(FakeCore(base_ex, base_info), prompts, 16)
    ex, info = make_executor(ckpt.path, k=3)
    assert greedy_generate(FakeCore(ex, info), prompts, 16, k=3, chunk=4, draft_depth=depth) == base


def _want(step: int, rid: str) -> int:
    """Drafts each request proposes per step: ``a`` none for 30 steps (longer than the carry ring
    holds, so its deferred depths catch up), then all 3; ``b`` cycles through 0-3; ``c`` all."""
    if rid == "a":
        return 0 if 2 <= step < 32 else 3
    return step % 4 if rid == "b" else -1


def test_requests_proposing_fewer_drafts_skip_those_mtp_depths(checkpoints, monkeypatch):
    """A request proposing ``p`` drafts after a step (``BatchInput.num_drafts``) runs only MTP depths
    below ``p``: one proposing none joins no MTP forward, except to catch up before the carry ring
    would lose the inputs of a deferred depth (every few steps, no head). Its MTP caches stay
    canonical: whenever it drafts again its drafts equal the full-recompute reference's, and it gets
    exactly the drafts it asked for; greedy output equals no speculation's."""
    ckpt = checkpoints["mixed_yarn"]
    ex, info = make_executor(ckpt.path, k=3)
    ran: list[tuple[int, str]] = []  # (depth, request) of every row an MTP forward took
    run_mtp = type(ex)._run_mtp

    def counting(self, d, spans, *args):
        ran.extend((d, self._last[0].request_ids[r]) for r, _, _ in spans)
        return run_mtp(self, d, spans, *args)

    monkeypatch.setattr(type(ex), "_run_mtp", counting)
    rng = random.Random(5)
    steps: list[dict[tuple[int, str], int]] = []
    checked: list[str] = []

    def check(batch, histories, drafts):
        step = len(steps)
        steps.append({key: ran.count(key) for key in set(ran)})
        ran.clear()
        for rid, dr in zip(batch.request_ids, drafts):
            want, sampled = _want(step, rid), batch.num_logits[batch.request_ids.index(rid)] > 0
            if sampled and want != 0:
                assert len(dr) == (3 if want < 0 else want), (step, rid, dr)
                assert dr == reference_drafts(ckpt, histories[rid], 3)[: len(dr)], (step, rid)
                checked.append(rid)
            elif sampled:
                assert dr == [], (step, rid)

    prompts = {"a": _prompt(31, 7), "b": _prompt(32, 5), "c": _prompt(33, 6)}
    greedy_generate(
        FakeCore(ex, info), prompts, 48, k=3, on_step=check, accept=lambda n: rng.randint(0, n), num_drafts=_want
    )
    assert {"a", "b", "c"} <= set(checked) and checked.count("a") >= 3
    # "a" proposing none: in a few of its 30 steps it catches up (every depth), otherwise it runs none.
    deferred = [s for s in steps[3:32]]
    catch_ups = [s for s in deferred if (0, "a") in s]
    assert 1 <= len(catch_ups) <= len(deferred) // 5, len(catch_ups)
    assert all((1, "a") in s and (2, "a") in s for s in catch_ups)
    # "b" proposing 1: depth 0 only, but for a catch-up now and then.
    one = [s for i, s in enumerate(steps) if i < 34 and _want(i, "b") == 1 and (0, "b") in s]
    assert one and sum((1, "b") in s for s in one) <= len(one) // 3
    base_ex, base_info = make_executor(ckpt.path)
    base = greedy_generate(FakeCore(base_ex, base_info), prompts, 40)
    ex, info = make_executor(ckpt.path, k=3)
    assert greedy_generate(FakeCore(ex, info), prompts, 40, k=3, num_drafts=_want) == base


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no_prefix_caching", "prefix_caching"])
def test_a_long_prefill_runs_each_mtp_depth_over_its_window_only(checkpoints, monkeypatch, prefix_caching):
    """An MTP block is a sliding layer, so a prefill computes each depth only over the positions a
    later query or the next depth reads (the last ``sliding_window`` ones for the deepest): far fewer
    rows than the prompt, and the drafts still equal the full-recompute reference's at every step.
    With prefix caching, also over what a later hit at 16 (the hit unit) reads."""
    ckpt = checkpoints["mixed_yarn"]
    ex, info = make_executor(ckpt.path, k=3, enable_prefix_caching=prefix_caching)
    window = ex.cfg.sliding_window
    first: dict[int, int] = {}  # depth -> rows of the first (prefill) step's MTP forward
    run_mtp = type(ex)._run_mtp

    def counting(self, d, spans, *args):
        if len(first) < 3 and d not in first:
            first[d] = sum(last - c + 1 for _, c, last in spans)
        return run_mtp(self, d, spans, *args)

    monkeypatch.setattr(type(ex), "_run_mtp", counting)
    rng = random.Random(9)
    checked: list[str] = []

    def check(batch, histories, drafts):
        for rid, dr in zip(batch.request_ids, drafts):
            if dr:
                assert dr == reference_drafts(ckpt, histories[rid], 3), (rid, len(histories[rid]))
                checked.append(rid)

    prompt = _prompt(41, 5 * window)
    greedy_generate(FakeCore(ex, info), {"a": prompt}, 10, k=3, on_step=check, accept=lambda n: rng.randint(0, n))
    assert len(checked) >= 4
    # The deepest depth (2) computes from n - 2 - window + 1, where its next query's window starts,
    # to the draft at n - 1; each shallower one from window - 1 before the next one's first input.
    n = len(prompt)
    if not prefix_caching:
        assert first == {2: window + 1, 1: 2 * window, 0: 3 * window - 1} and first[0] < n - 1, first
        return
    # A hit at 16 reads depth d's KV at 16 - d - window .. 16 - d - 2 and snapshots its input at
    # 16 - d - 1: the deepest depth then starts at 16 - 2 - 2 - window + 1 (its query at 12), and each
    # shallower one window - 1 before the next one's first input, as above.
    assert window == 4 and n == 20 and ex.hit_unit == 16
    assert first == {2: 11, 1: 14, 0: 17}, first


def test_preemption_and_slot_reuse_keep_drafts_exact(checkpoints):
    """A preempted request recomputes from scratch and a new request reusing its ring slot and MTP
    state starts clean: drafts still equal the full-recompute reference at every step."""
    ckpt = checkpoints["csa_heavy"]
    ex, info = make_executor(ckpt.path, k=2, max_num_seqs=1)
    rng = random.Random(7)

    def check(batch, histories, drafts):
        for rid, dr in zip(batch.request_ids, drafts):
            if dr:
                assert dr == reference_drafts(ckpt, histories[rid], 2)

    core = FakeCore(ex, info)
    greedy_generate(
        core,
        {"a": _prompt(8, 10)},
        10,
        k=2,
        preempt_at={"a": 5},
        on_step=check,
        accept=lambda n: rng.randint(0, n),
    )
    greedy_generate(core, {"z": _prompt(9, 7)}, 10, k=2, on_step=check, accept=lambda n: rng.randint(0, n))
    assert ex.slots == {} and ex.mtp_state == {}


def test_main_logits_after_forced_acceptance_match_transformers(checkpoints):
    """Multi-token commits through the verification path leave the main caches exact."""
    ckpt = checkpoints["mixed_yarn"]
    ex, info = make_executor(ckpt.path, k=3)
    rng = random.Random(3)
    last: dict[str, list[int]] = {}

    def keep(batch, histories, drafts):
        last.update(histories)

    out = greedy_generate(
        FakeCore(ex, info), {"a": _prompt(10, 8)}, 15, k=3, on_step=keep, accept=lambda n: rng.randint(0, n)
    )
    hist = last["a"]
    # Every committed token after the first equals HF's argmax given the prefix before it, unless it
    # was a force-accepted draft; check the bonus tokens by replaying HF over the final history.
    assert len(out["a"]) == 15 and hist[-15:] == out["a"]
    with torch.no_grad():
        ref = ckpt.hf(torch.tensor([hist[:-1]])).logits[0].argmax(-1).tolist()
    ours_ex, ours_info = make_executor(ckpt.path)
    core = FakeCore(ours_ex, ours_info)
    mine = ours_ex.execute(core.batch([("x", hist[:-1], 0, len(hist) - 1)])).argmax(-1).tolist()
    assert mine == ref
