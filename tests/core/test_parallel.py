"""The tensor/expert-parallel building blocks of :mod:`pypto_serving.parallel` on two gloo ranks
(spawned processes), against plain torch on one process: the vocab-parallel embedding against
``F.embedding``, ``all_gather`` against ``torch.cat``, and the expert-parallel dispatch/combine
against a per-token, per-route loop over every expert, with each route computed on one rank only."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pypto_serving.parallel import ParallelContext, dispatch_combine, expert_parallel_moe, vocab_parallel_embedding
from tests.distributed_helpers import run_ranks

WORLD = 2
E, H, INTER, K = 6, 8, 5, 2  # experts, hidden, expert intermediate, routes per token


def _experts(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * INTER, H, generator=gen), torch.randn(E, H, INTER, generator=gen)


def _routes(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, H, generator=gen)
    scores = torch.rand(num_tokens, E, generator=gen)
    weights, ids = torch.topk(scores.softmax(-1), K, dim=-1)
    return x, weights, ids


def _expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = (gate_up @ x).split(INTER)
    return down @ (F.silu(gate) * up)


def _brute_force(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """One token and one route at a time, every expert at hand."""
    gate_up, down = _experts()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(K):
            e = int(ids[t, j])
            out[t] += weights[t, j] * _expert(x[t], gate_up[e], down[e])
    return out


def _local_fn(first: int, count: int, computed: list[int]) -> Any:
    """This rank's experts ``first .. first + count - 1`` as an ExpertFn (local ids from 0; ``count``
    marks a route another rank owns). Appends to ``computed`` the routes each call computes."""
    gate_up, down = _experts()
    gate_up, down = gate_up[first : first + count], down[first : first + count]

    def run(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        assert int(ids.min()) >= 0 and int(ids.max()) <= count, "a route reached the wrong rank's experts"
        kept = ids < count
        assert bool((weights[~kept] == 0).all()), "a dropped route carries a weight"
        computed.append(int(kept.sum()))
        safe = torch.where(kept, ids, 0)
        h = torch.einsum("nkoh,nh->nko", gate_up[safe], x)
        act = F.silu(h[..., :INTER]) * h[..., INTER:]
        routed = torch.einsum("nkhi,nki->nkh", down[safe], act) * weights.unsqueeze(-1)
        return torch.where(kept.unsqueeze(-1), routed, 0.0).sum(1)

    return run


def _rank_checks() -> dict[str, Any]:
    ctx = ParallelContext.current()
    per = E // ctx.world_size
    computed: list[int] = []
    local = _local_fn(ctx.rank * per, per, computed)
    out: dict[str, Any] = {"rank": ctx.rank, "world": ctx.world_size}
    # Tokens every rank holds alike (tensor-parallel attention); 5 rows do not split evenly over 2.
    for n in (5, 8, 1):
        x, w, ids = _routes(n, seed=n)
        out[f"replicated{n}"] = expert_parallel_moe(x, w, ids, local, E, ctx)
        out[f"computed{n}"] = computed.pop()
    # Each rank's own tokens (same count, different values).
    x, w, ids = _routes(4, seed=100 + ctx.rank)
    out["own"] = dispatch_combine(x, w, ids, local, per, ctx)
    table = torch.randn(16, 3, generator=torch.Generator().manual_seed(7))
    ids_v = torch.tensor([0, 15, 7, 8, 3, 12, 8])
    out["embedding"] = vocab_parallel_embedding(ids_v, table[ctx.shard(16)], ctx)
    out["gathered"] = ctx.all_gather(torch.full((2, 3), float(ctx.rank)), dim=1)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(_rank_checks, WORLD)


def test_ranks_see_their_place(ranks: list[dict[str, Any]]) -> None:
    assert [(r["rank"], r["world"]) for r in ranks] == [(0, 2), (1, 2)]


@pytest.mark.parametrize("n", [5, 8, 1])
def test_expert_parallel_moe_matches_a_per_token_loop(ranks: list[dict[str, Any]], n: int) -> None:
    x, w, ids = _routes(n, seed=n)
    want = _brute_force(x, w, ids)
    for r in ranks:
        torch.testing.assert_close(r[f"replicated{n}"], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [5, 8, 1])
def test_each_route_is_computed_once_over_the_ranks(ranks: list[dict[str, Any]], n: int) -> None:
    """Every rank computes only the routes to its own experts (and none for the rows padding the batch
    to a multiple of the ranks), so the ranks together compute each of the ``n x K`` routes once."""
    _, _, ids = _routes(n, seed=n)
    per = E // WORLD
    want = [int((ids // per == r).sum()) for r in range(WORLD)]
    assert [r[f"computed{n}"] for r in ranks] == want
    assert sum(want) == n * K


def test_dispatch_combine_serves_each_ranks_own_tokens(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        x, w, ids = _routes(4, seed=100 + r["rank"])
        torch.testing.assert_close(r["own"], _brute_force(x, w, ids), rtol=1e-5, atol=1e-5)


def test_vocab_parallel_embedding_and_all_gather_match_plain_torch(ranks: list[dict[str, Any]]) -> None:
    table = torch.randn(16, 3, generator=torch.Generator().manual_seed(7))
    want = F.embedding(torch.tensor([0, 15, 7, 8, 3, 12, 8]), table)
    for r in ranks:
        assert torch.equal(r["embedding"], want)
        assert torch.equal(r["gathered"], torch.cat([torch.zeros(2, 3), torch.ones(2, 3)], dim=1))


def test_one_rank_runs_the_experts_directly() -> None:
    x, w, ids = _routes(3, seed=3)
    got = expert_parallel_moe(x, w, ids, _local_fn(0, E, []), E, ParallelContext())
    torch.testing.assert_close(got, _brute_force(x, w, ids), rtol=1e-5, atol=1e-5)


def test_experts_that_do_not_split_evenly_are_refused_by_name() -> None:
    x, w, ids = _routes(2, seed=2)
    ctx = ParallelContext(rank=0, world_size=4)  # 6 experts over 4 ranks
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not divide the number of experts"):
        expert_parallel_moe(x, w, ids, _local_fn(0, E, []), E, ctx)
