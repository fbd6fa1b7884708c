"""The block bookkeeping of KV transfers (kv_ledger.py) against the KV manager's invariants: every block
a transfer touches has one owner until the connector's event, and then goes back to the pool."""

from __future__ import annotations

from multiprocessing import Pipe
from multiprocessing.connection import Connection
from typing import Any

import pytest

from pypto_serving.config import KVTransferConfig
from pypto_serving.executor import CacheGroupSpec
from pypto_serving.kv_cache import FREED, KVCacheManager
from pypto_serving.kv_ledger import KVLinks, KVTransferLedger, prompt_digest
from pypto_serving.kv_transfer import TransferEvent
from pypto_serving.request import Request, RequestStatus, SamplingParams

GROUPS = [CacheGroupSpec("kv", 4, 64), CacheGroupSpec("idx", 4, 16, tokens_per_entry=2)]  # 8 tokens per idx block
ADDRESS = {"remote_host": "127.0.0.1", "remote_port": 1}


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def _ledger(role: str, timeout: float = 5.0) -> tuple[KVTransferLedger, list[tuple[Any, ...]], Clock]:
    kv = KVCacheManager(GROUPS, {"kv": 16, "idx": 8}, enable_prefix_caching=False)
    sent: list[tuple[Any, ...]] = []
    clock = Clock()
    cfg = KVTransferConfig(kv_role=role, kv_transfer_timeout=timeout)  # type: ignore[call-arg]
    return KVTransferLedger(cfg, kv, sent.append, ADDRESS, clock), sent, clock


def _free(ledger: KVTransferLedger) -> dict[str, int]:
    return {name: pool.num_free for name, pool in ledger.kv.pools.items()}


FULL = {"kv": 16, "idx": 8}


def _finished_prefill(ledger: KVTransferLedger, n: int) -> Request:
    """A do_remote_decode request that computed its ``n`` prompt tokens and one output."""
    req = Request("p", list(range(n)), SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    assert ledger.kv.allocate(req, n + 1)
    req.output_token_ids.append(7)
    req.status = RequestStatus.FINISHED_LENGTH
    return req


def test_a_prefill_holds_the_prompt_blocks_until_they_are_sent() -> None:
    ledger, sent, _ = _ledger("prefill")
    req = _finished_prefill(ledger, 13)  # 14 tokens: kv 4 blocks, idx 2 blocks
    assert ledger.hold(req)
    # 12 prompt tokens move: kv keeps 3 blocks, idx 2; the kv block of the 13th and 14th token is freed.
    ((kind, tid, blocks),) = sent
    assert kind == "publish" and {g: len(b) for g, b in blocks.items()} == {"kv": 3, "idx": 2}
    assert _free(ledger) == {"kv": 13, "idx": 6}
    ledger.kv.check_invariants(ledger.owners())
    params = req.out.kv_transfer_params
    assert params is not None and params["transfer_id"] == tid and params["num_tokens"] == 12
    assert params["prompt_digest"] == prompt_digest(req.prompt_token_ids) and params["remote_port"] == 1
    ledger.on_event(TransferEvent(tid, "sent"))
    assert _free(ledger) == FULL and not ledger.held
    ledger.kv.check_invariants([])


def test_an_unpulled_offer_is_withdrawn_at_the_timeout_and_freed_on_the_event() -> None:
    ledger, sent, clock = _ledger("prefill", timeout=2.0)
    assert ledger.hold(_finished_prefill(ledger, 9))
    tid = sent[0][1]
    clock.now = 1.0
    ledger.tick()
    assert len(sent) == 1  # not yet
    clock.now = 2.5
    ledger.tick()
    ledger.tick()
    assert sent[1:] == [("withdraw", tid)]  # once
    assert _free(ledger) != FULL  # the connector may still be sending: freed only on its event
    ledger.on_event(TransferEvent(tid, "sent", "withdrawn"))
    assert _free(ledger) == FULL
    assert ledger.stats["kv_send_failed"] == 1


def test_failed_or_aborted_prefills_and_plain_requests_are_not_held() -> None:
    ledger, sent, _ = _ledger("prefill")
    for status in (RequestStatus.FINISHED_ERROR, RequestStatus.FINISHED_ABORTED):
        req = _finished_prefill(ledger, 9)
        req.status = status
        assert not ledger.hold(req)
        ledger.kv.free(req)
    plain = Request("q", [1, 2, 3], SamplingParams())
    assert not ledger.hold(plain)
    assert not sent and _free(ledger) == FULL


def _decode_request(n: int = 13, rid: str = "d") -> Request:
    prompt = list(range(n))
    params = {
        "do_remote_prefill": True,
        "transfer_id": "t",
        "num_tokens": n - 1,
        "prompt_digest": prompt_digest(prompt),
        **ADDRESS,
    }
    return Request(rid, prompt, SamplingParams(kv_transfer_params=params))


def test_a_decode_pull_owns_its_blocks_until_the_event_and_a_failure_frees_them() -> None:
    ledger, sent, _ = _ledger("decode")
    ok, bad = _decode_request(rid="ok"), _decode_request(rid="bad")
    for req in (ok, bad):
        ledger.check(req, 1)
        assert ledger.start_pull(req)
    assert [m[0] for m in sent] == ["pull", "pull"]
    assert {g: len(b) for g, b in sent[0][3].items()} == {"kv": 3, "idx": 2}  # 12 tokens
    ledger.kv.check_invariants(ledger.owners())
    req, good = ledger.on_event(TransferEvent("bad", "pulled", "peer died"))
    assert req is bad and not good and bad.status is RequestStatus.FINISHED_ERROR
    assert bad.error == "KV transfer failed: peer died" and not bad.kv.block_ids
    req, good = ledger.on_event(TransferEvent("ok", "pulled"))
    assert req is ok and good and ok.kv.capacity >= 12
    ledger.kv.free(ok)
    assert _free(ledger) == FULL


def test_an_aborted_pull_is_freed_when_the_connector_lets_go() -> None:
    ledger, _sent, _ = _ledger("decode")
    req = _decode_request()
    ledger.start_pull(req)
    assert ledger.abort("d") is None  # the connector may be writing the blocks
    assert _free(ledger) != FULL
    done, good = ledger.on_event(TransferEvent("d", "pulled"))
    assert done is req and not good and req.status is RequestStatus.FINISHED_ABORTED
    assert _free(ledger) == FULL


def test_a_pull_without_room_waits_and_starts_on_a_later_tick() -> None:
    ledger, sent, _ = _ledger("decode")
    hog = Request("hog", [0], SamplingParams())
    assert ledger.kv.allocate(hog, 16 * 4)  # every kv block
    req = _decode_request()
    assert ledger.start_pull(req) and not sent
    assert ledger.abort("d") is req and req.status is RequestStatus.FINISHED_ABORTED  # never started: at once
    req = _decode_request(rid="d2")
    ledger.start_pull(req)
    ledger.kv.free(hog)
    ledger.tick()
    assert [m[0] for m in sent] == ["pull"]


def test_pulls_start_only_into_seats() -> None:
    """A decode engine with one seat left (``max_num_seqs`` less its running and waiting requests)
    pulls one prompt at a time, though the pool has room for both: a pulled request waits for a seat
    before its blocks are taken, not holding them in the queue."""
    ledger, sent, _ = _ledger("decode")
    seats = [1]
    ledger.seats = lambda: seats[0]
    first, second = _decode_request(rid="a"), _decode_request(rid="b")
    for req in (first, second):
        ledger.check(req, 1)
        assert ledger.start_pull(req)
    assert [m[1] for m in sent] == ["a"] and not second.kv.block_ids
    ledger.tick()
    assert len(sent) == 1  # the seat is the pull in flight's
    req, good = ledger.on_event(TransferEvent("a", "pulled"))
    assert req is first and good
    seats[0] = 0  # "a" now waits in the scheduler: still no seat
    ledger.tick()
    assert len(sent) == 1
    seats[0] = 1  # "a" finished
    ledger.tick()
    assert [m[1] for m in sent] == ["a", "b"] and second.kv.block_ids
    ledger.kv.free(first)
    ledger.kv.check_invariants([second], [])


@pytest.mark.parametrize(
    ("role", "change", "match"),
    [
        ("prefill", {}, "needs kv_role 'decode'"),
        ("decode", {"prompt_digest": "x"}, "another prompt"),
        ("decode", {"num_tokens": 3}, "num_tokens"),
        ("decode", {"transfer_id": None}, "lacks transfer_id"),
        ("decode", {"prompt_logprobs": 1}, "prompt_logprobs"),
    ],
)
def test_requests_a_role_cannot_serve_are_refused(role: str, change: dict[str, Any], match: str) -> None:
    ledger, _, _ = _ledger(role)
    req = _decode_request()
    params = dict(req.sampling_params.kv_transfer_params or {})
    req.sampling_params.prompt_logprobs = change.pop("prompt_logprobs", None)
    params.update(change)
    params = {k: v for k, v in params.items() if v is not None}
    req.sampling_params.kv_transfer_params = params
    with pytest.raises(ValueError, match=match):
        ledger.check(req, 1)


def test_the_settings_take_vllm_roles_and_refuse_contradictions() -> None:
    from pypto_serving import ServingSettings

    assert ServingSettings(kv_transfer_config={"kv_role": "kv_consumer"}).kv_transfer().kv_role == "decode"  # type: ignore[union-attr]
    assert ServingSettings(kv_role="prefill").kv_transfer().kv_port == 0  # type: ignore[union-attr]
    assert ServingSettings().kv_transfer() is None
    with pytest.raises(ValueError, match="contradicts"):
        ServingSettings(kv_role="prefill", kv_transfer_config={"kv_role": "decode"})
    with pytest.raises(ValueError, match="its own port"):
        ServingSettings(kv_role="prefill", kv_transfer_config={"kv_port": 14579}, data_parallel_size=2)
    with pytest.raises(ValueError, match="rank r's connector listens on kv_port \\+ r, past 65535"):
        ServingSettings(kv_role="prefill", kv_transfer_config={"kv_port": 65535}, tensor_parallel_size=2)


# A sliding window of 8 tokens (4 a block) and a group of 8 tokens a block: a computation can start
# only at multiples of 8 (the hit unit), and from a start at p it reads the window blocks from p - 7.
WINDOWED = [CacheGroupSpec("win", 4, 64, window_tokens=8), CacheGroupSpec("full", 4, 16, tokens_per_entry=2)]


def _windowed_ledger(role: str, sent: list[tuple[Any, ...]]) -> KVTransferLedger:
    kv = KVCacheManager(WINDOWED, {"win": 16, "full": 8})
    cfg = KVTransferConfig(kv_role=role)  # type: ignore[call-arg]
    return KVTransferLedger(cfg, kv, sent.append, ADDRESS)


def test_windowed_groups_move_the_blocks_a_start_at_the_hit_unit_reads() -> None:
    """The prefill side offers ``prompt - 1`` rounded down to the hit unit; the window blocks given
    back during the prefill (FREED entries) that the start reads come back from the prefix cache, the
    ones it never reads are not sent; the decode side gives back the same entries, so both sides'
    block lists pair up, and every block is freed after the events."""
    sent: list[tuple[Any, ...]] = []
    prefill = _windowed_ledger("prefill", sent)
    req = _finished_prefill(prefill, 21)  # 22 tokens: win 6 blocks, full 3
    prefill.kv.publish(req, 22)
    win_ids = list(req.kv.block_ids["win"])
    prefill.kv.release_outside_window(req, 21)  # win blocks 0..2 go back (still cached)
    assert req.kv.block_ids["win"][:3] == [FREED] * 3
    assert prefill.hold(req)
    ((_, tid, offered),) = sent
    assert req.out.kv_transfer_params is not None and req.out.kv_transfer_params["num_tokens"] == 16
    # A start at 16 reads positions 9..15 of the window: win blocks 2 (given back, taken again from
    # the cache) and 3; full blocks 0 and 1. Nothing past 16 and no earlier window block moves.
    assert offered == {"win": win_ids[2:4], "full": req.kv.block_ids["full"]}
    assert len(offered["full"]) == 2 and req.kv.block_ids["win"][:2] == [FREED] * 2
    prefill.kv.check_invariants(prefill.owners())

    decode = _windowed_ledger("decode", sent)
    dreq = _decode_request(22, "d")
    params = dreq.sampling_params.kv_transfer_params
    assert params is not None
    params["num_tokens"] = 20  # not a start the hit unit allows
    with pytest.raises(ValueError, match="this prompt needs 16"):
        decode.check(dreq, 1)
    params["num_tokens"] = 16
    decode.check(dreq, 1)
    assert decode.start_pull(dreq)
    kind, _rid, _source, wanted = sent[-1]
    assert kind == "pull" and {g: len(b) for g, b in wanted.items()} == {"win": 2, "full": 2}
    assert dreq.kv.block_ids["win"][:2] == [FREED] * 2 and len(dreq.kv.block_ids["win"]) == 4
    decode.kv.check_invariants(decode.owners())

    prefill.on_event(TransferEvent(tid, "sent"))
    pulled, ok = decode.on_event(TransferEvent("d", "pulled"))
    assert pulled is dreq and ok
    decode.kv.free(dreq)
    for ledger in (prefill, decode):
        ledger.kv.check_invariants([])
        assert all(p.num_free == p.num_blocks for p in ledger.kv.pools.values())


def test_an_evicted_window_block_shortens_the_offer() -> None:
    """A window block the start needs was given back and reused meanwhile: the offer falls to the
    longest start still served (here none: nothing moves, the request's blocks are freed)."""
    sent: list[tuple[Any, ...]] = []
    prefill = _windowed_ledger("prefill", sent)
    req = _finished_prefill(prefill, 21)
    prefill.kv.publish(req, 22)
    prefill.kv.release_outside_window(req, 21)
    taken = prefill.kv.pools["win"].allocate(13)  # every free win block, then blocks 0..2 evicted
    assert not prefill.hold(req)
    assert not sent and req.out.kv_transfer_params is not None and req.out.kv_transfer_params["num_tokens"] == 0
    prefill.kv.free(req)
    prefill.kv.pools["win"].release(taken)
    prefill.kv.check_invariants([])
    assert all(p.num_free == p.num_blocks for p in prefill.kv.pools.values())


# -- KVLinks: the engine's side of one connector per tensor-parallel rank
RANK_ADDRESSES = [{"remote_host": "h", "remote_port": 10 + r, "layout": "x"} for r in range(2)]


def _links(n: int) -> tuple[KVLinks, list[Connection]]:
    """Links over ``n`` in-process pipes, each rank's end already having sent its connector's address."""
    pairs = [Pipe() for _ in range(n)]
    for rank, (_, worker) in enumerate(pairs):
        worker.send(("address", RANK_ADDRESSES[rank]))
    links = KVLinks([engine for engine, _ in pairs])
    return links, [worker for _, worker in pairs]


def _received(worker: Connection) -> list[Any]:
    got = []
    while worker.poll(0):
        got.append(worker.recv())
    return got


def test_links_over_one_rank_pass_messages_and_events_unchanged() -> None:
    links, (worker,) = _links(1)
    assert links.start(timeout=1) == RANK_ADDRESSES[0]
    links.send(("publish", "t", {"kv": [1, 2]}))
    links.send(("pull", "r", {**RANK_ADDRESSES[0], "transfer_id": "u"}, {"kv": [3]}))
    assert _received(worker) == [
        ("publish", "t", {"kv": [1, 2]}),
        ("pull", "r", {**RANK_ADDRESSES[0], "transfer_id": "u"}, {"kv": [3]}),
    ]
    worker.send(TransferEvent("t", "sent", "boom"))
    assert links.events(1.0) == [TransferEvent("t", "sent", "boom")]


def test_a_transfer_over_ranks_ends_when_every_rank_reported_it_with_any_ranks_error() -> None:
    links, workers = _links(2)
    address = links.start(timeout=1)
    assert address["remote_port"] == 10 and address["ranks"] == RANK_ADDRESSES
    links.send(("publish", "t", {"kv": [1, 2]}))
    assert [_received(w) for w in workers] == [[("publish", "t", {"kv": [1, 2]})]] * 2
    workers[0].send(TransferEvent("t", "sent"))
    assert links.events(0.05) == []  # rank 1 may still read its blocks
    workers[1].send(TransferEvent("t", "sent", "peer gone"))
    assert links.events(1.0) == [TransferEvent("t", "sent", "rank 1: peer gone")]
    # A pull goes to each rank with the address of the prefill engine's rank of the same index.
    source = {**address, "transfer_id": "t2"}
    links.send(("pull", "r", source, {"kv": [5]}))
    for rank, worker in enumerate(workers):
        ((kind, rid, rank_source, blocks),) = _received(worker)
        assert (kind, rid, blocks) == ("pull", "r", {"kv": [5]})
        assert rank_source["remote_port"] == 10 + rank and rank_source["transfer_id"] == "t2"
    workers[1].send(TransferEvent("r", "pulled"))
    workers[0].send(TransferEvent("r", "pulled"))
    assert links.events(1.0) == [TransferEvent("r", "pulled", None)]
    links.close()
    assert [_received(w) for w in workers] == [[("close",)]] * 2


@pytest.mark.parametrize(("decode_ranks", "source_ranks"), [(1, 2), (2, 1)])
def test_a_pull_across_tensor_parallel_sizes_fails_unsent(decode_ranks: int, source_ranks: int) -> None:
    links, workers = _links(decode_ranks)
    links.start(timeout=1)
    source: dict[str, Any] = {**RANK_ADDRESSES[0], "transfer_id": "t"}
    if source_ranks > 1:
        source["ranks"] = RANK_ADDRESSES[:source_ranks]
    links.send(("pull", "r", source, {"kv": [1]}))
    assert all(_received(w) == [] for w in workers)
    ((event,),) = [links.events(0.0)]
    assert event.transfer_id == "r" and event.kind == "pulled"
    assert event.error == (
        f"the prefill engine runs tensor_parallel_size={source_ranks} and this decode engine {decode_ranks}: "
        "the KV moves rank to rank, so both need the same tensor_parallel_size"
    )
    links.send(("pull", "q", {**source, "ranks": "nonsense"}, {"kv": [1]}))
    assert links.events(0.0)[0].error == "kv_transfer_params.ranks is not a list of the prefill engine's rank addresses"


# -- streamed offers (stream_kv): published chunk by chunk, each part referenced by the offer itself
def _streaming(n: int) -> tuple[KVTransferLedger, list[tuple[Any, ...]], Request]:
    ledger, sent, _ = _ledger("prefill")
    ledger.address = {**ADDRESS, "streams": True}
    params = {"do_remote_decode": True, "stream_kv": True}
    req = Request("p", list(range(n)), SamplingParams(max_tokens=1, kv_transfer_params=params))
    ledger.check(req, 1)
    ledger.open_stream(req)
    return ledger, sent, req


def _check(ledger: KVTransferLedger, *live: Request) -> None:
    ledger.kv.check_invariants([*live, *ledger.owners()], ledger.pinned())


def _computed(ledger: KVTransferLedger, req: Request, end: int) -> None:
    """A step's result for ``req`` applied: its tokens before ``end`` confirmed, then published."""
    req.sched.confirmed = end
    ledger.publish_computed([req], [end])


def test_a_streamed_offer_grows_by_the_full_blocks_of_each_chunk_and_survives_preemption() -> None:
    ledger, sent, req = _streaming(21)  # 20 tokens move: kv 5 blocks, idx 3 (the last one partial)
    tid = sent[0][1]
    assert sent[0] == ("publish_part", tid, {"kv": [], "idx": []}, False, True)
    assert req.out.kv_transfer_params is not None and req.out.kv_transfer_params["num_tokens"] == 20
    assert ledger.kv.allocate(req, 10)
    _computed(ledger, req, 10)  # 10 tokens computed: 2 kv blocks and 1 idx block are full
    assert sent[1] == (
        "publish_part",
        tid,
        {"kv": req.kv.block_ids["kv"][:2], "idx": req.kv.block_ids["idx"][:1]},
        False,
        False,
    )
    _check(ledger, req)
    first = sent[1][2]
    ledger.kv.free(req)  # preempted: its own references go, the offer's stay
    req.sched.confirmed = 0
    assert all(ledger.kv.pools[g].ref_cnt[b] == 1 for g, bs in first.items() for b in bs)
    _check(ledger)
    assert ledger.kv.allocate(req, 16)
    _computed(ledger, req, 16)  # recomputed: only the blocks past the published ones go out
    assert sent[2][2] == {"kv": req.kv.block_ids["kv"][2:4], "idx": req.kv.block_ids["idx"][1:2]}
    assert ledger.kv.allocate(req, 22)
    _computed(ledger, req, 22)  # capped at the 20 tokens that move
    assert sent[3][2] == {"kv": req.kv.block_ids["kv"][4:5], "idx": []}
    req.output_token_ids.append(7)
    req.status = RequestStatus.FINISHED_LENGTH
    assert ledger.hold(req)
    assert sent[4] == ("publish_part", tid, {"kv": [], "idx": req.kv.block_ids["idx"][2:3]}, True, False)
    _check(ledger)
    ledger.on_event(TransferEvent(tid, "sent", None, {"parts": 4}))
    assert _free(ledger) == FULL and not ledger.held and not ledger.streams
    assert ledger.stats["kv_sent"] == 1 and ledger.stats["kv_parts_sent"] == 4
    ledger.kv.check_invariants([])


def test_a_step_preempted_in_flight_publishes_nothing_though_the_request_holds_new_blocks() -> None:
    """Async: the request was preempted while its step ran (nothing of that step confirmed) and holds
    fresh blocks again when the step's result arrives; the ledger publishes none of them, since no
    step wrote them yet (before, the step's end published them as computed), and the recomputed
    chunk goes out when it is confirmed."""
    ledger, sent, req = _streaming(21)
    assert ledger.kv.allocate(req, 16)
    ledger.kv.free(req)  # preempted in flight ...
    req.sched.confirmed = 0
    assert ledger.kv.allocate(req, 16)  # ... and readmitted: blocks nobody has written yet
    ledger.publish_computed([req], [16])  # the discarded step's result
    assert len(sent) == 1
    _computed(ledger, req, 16)  # the recompute
    assert sent[1][2] == {"kv": req.kv.block_ids["kv"][:4], "idx": req.kv.block_ids["idx"][:2]}
    _check(ledger, req)


@pytest.mark.parametrize("status", [RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR])
def test_a_streamed_prefill_that_fails_withdraws_its_offer(status: RequestStatus) -> None:
    ledger, sent, req = _streaming(21)
    tid = sent[0][1]
    assert ledger.kv.allocate(req, 16)
    _computed(ledger, req, 16)
    req.status = status
    assert not ledger.hold(req)  # the scheduler frees the request's blocks ...
    assert sent[-1] == ("withdraw", tid)
    ledger.kv.free(req)
    assert _free(ledger) != FULL  # ... the offer's parts stay until the connector lets go
    _check(ledger)
    ledger.on_event(TransferEvent(tid, "sent", "withdrawn"))
    assert _free(ledger) == FULL and not ledger.held and ledger.stats["kv_send_failed"] == 1
    ledger.kv.check_invariants([])


def test_a_streamed_offer_whose_send_failed_publishes_nothing_more() -> None:
    ledger, sent, req = _streaming(21)
    tid = sent[0][1]
    assert ledger.kv.allocate(req, 8)
    _computed(ledger, req, 8)
    ledger.on_event(TransferEvent(tid, "sent", "sending the KV failed: the decode engine went away"))
    _check(ledger, req)  # the parts are freed at once; the request keeps its own blocks
    assert ledger.kv.allocate(req, 16)
    _computed(ledger, req, 16)
    req.status = RequestStatus.FINISHED_LENGTH
    assert not ledger.hold(req)  # nothing held: the scheduler frees it as any request
    assert len(sent) == 2
    ledger.kv.free(req)
    assert _free(ledger) == FULL and not ledger.streams and not ledger.held


# -- streamed offers with hit-aligned groups: the hit is fixed as the offer opens, and each part holds
# the blocks a start there reads that the chunks so far filled.
def _windowed_stream(sent: list[tuple[Any, ...]], rest: bool = True) -> tuple[KVTransferLedger, Request, str]:
    """A streamed 22-token prefill (a hit at 16) after its first 8-token chunk; ``rest``: and after a
    step computing the other 14, its result applied up to the ledger's turn."""
    ledger = _windowed_ledger("prefill", sent)
    ledger.address = {**ADDRESS, "streams": True}
    params = {"do_remote_decode": True, "stream_kv": True}
    req = Request("p", list(range(22)), SamplingParams(max_tokens=1, kv_transfer_params=params))
    ledger.check(req, 1)
    ledger.open_stream(req)
    assert req.out.kv_transfer_params is not None and req.out.kv_transfer_params["num_tokens"] == 16
    assert ledger.kv.allocate(req, 8)
    req.sched.confirmed = 8  # the step's result is applied (the scheduler counts it before the ledger's turn)
    ledger.publish_computed([req], [8])  # 8 tokens: full block 0; win blocks 0, 1 lie before the hit's window
    assert sent[-1] == ("publish_part", sent[0][1], {"win": [], "full": req.kv.block_ids["full"][:1]}, False, False)
    # The rest of the prompt in one step: its result gives back win blocks 0..2 (published to the
    # prefix cache just before) ahead of the ledger's turn, though a start at 16 reads block 2.
    assert ledger.kv.allocate(req, 22)
    if rest:
        req.sched.confirmed = 22
        ledger.kv.publish(req, 22)
    return ledger, req, sent[0][1]


def test_a_streamed_offer_of_windowed_groups_moves_the_hit_s_blocks_as_they_fill() -> None:
    sent: list[tuple[Any, ...]] = []
    ledger, req, tid = _windowed_stream(sent)
    win, full = list(req.kv.block_ids["win"]), list(req.kv.block_ids["full"])
    ledger.kv.release_outside_window(req, 22)
    assert req.kv.block_ids["win"][:3] == [FREED] * 3
    ledger.publish_computed([req], [22])  # capped at the hit (16): win 2 (from the cache) and 3, full 1
    assert sent[-1] == ("publish_part", tid, {"win": win[2:4], "full": full[1:2]}, False, False)
    _check(ledger, req)
    req.output_token_ids.append(7)
    req.status = RequestStatus.FINISHED_LENGTH
    assert not ledger.hold(req)  # the offer references every block it moves: the request's go as usual
    assert sent[-1] == ("publish_part", tid, {"win": [], "full": []}, True, False)
    ledger.kv.free(req)
    assert _free(ledger) == {"win": 14, "full": 6}
    _check(ledger)
    ledger.on_event(TransferEvent(tid, "sent", None, {"parts": 3}))
    assert not ledger.held and not ledger.streams and ledger.stats["kv_parts_sent"] == 3
    ledger.kv.check_invariants([])
    assert all(p.num_free == p.num_blocks for p in ledger.kv.pools.values())


def test_a_streamed_offer_whose_window_block_was_evicted_is_withdrawn() -> None:
    """A window block the hit needs was given back and reused before the ledger took it: the offer
    cannot complete, so it is withdrawn (the decode engine's pull fails with the reason) rather than
    sent with a block of other content; nothing more goes out and every block is freed."""
    sent: list[tuple[Any, ...]] = []
    ledger, req, tid = _windowed_stream(sent)
    ledger.kv.release_outside_window(req, 22)
    taken = ledger.kv.pools["win"].allocate(13)  # every free win block: the cached ones are evicted
    ledger.publish_computed([req], [22])
    assert sent[-1] == ("withdraw", tid) and tid in ledger.held
    ledger.kv.check_invariants([req, *ledger.owners()], [*ledger.pinned(), {"win": taken}])
    req.output_token_ids.append(7)
    req.status = RequestStatus.FINISHED_LENGTH
    assert not ledger.hold(req) and sent[-1] == ("withdraw", tid)
    ledger.kv.free(req)
    ledger.kv.pools["win"].release(taken)
    ledger.on_event(TransferEvent(tid, "sent", "withdrawn"))
    assert not ledger.held and not ledger.streams and ledger.stats["kv_send_failed"] == 1
    ledger.kv.check_invariants([])
    assert all(p.num_free == p.num_blocks for p in ledger.kv.pools.values())


def test_a_streamed_step_preempted_in_flight_publishes_nothing() -> None:
    """Async: the request was preempted while its step ran, so the step's result is discarded (its
    blocks freed, nothing of it confirmed or cached); the ledger publishes nothing for it and keeps the
    offer open (no withdrawal), and the recomputed chunks go out later."""
    sent: list[tuple[Any, ...]] = []
    ledger, req, tid = _windowed_stream(sent, rest=False)
    parts = len(sent)
    ledger.kv.free(req)
    req.sched.confirmed = 0
    ledger.publish_computed([req], [22])
    assert len(sent) == parts and tid in ledger.streams and not ledger.held
    _check(ledger, req)
    assert ledger.kv.allocate(req, 22)
    req.sched.confirmed = 22  # recomputed (here in one step)
    ledger.publish_computed([req], [22])
    assert sent[-1] == (
        "publish_part",
        tid,
        {"win": req.kv.block_ids["win"][2:4], "full": req.kv.block_ids["full"][1:2]},
        False,
        False,
    )
    _check(ledger, req)
