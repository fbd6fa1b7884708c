"""The ``torch_p2p`` connector on its own: two connectors in one process over loopback, moving blocks of
small CPU caches; what arrives is compared with the producer's blocks."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from pypto_serving.config import KVTransferConfig
from pypto_serving.kv_connectors.torch_p2p import TorchP2PConnector
from pypto_serving.kv_transfer import Offers, TransferEvent


def _caches(seed: int) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {"kv": [torch.randn(8, 2, 4, generator=g), torch.randn(8, 2, 4, generator=g)]}


def _connector(role: str, **extra: Any) -> TorchP2PConnector:
    extra = {"timeout": 10, **extra}
    return TorchP2PConnector(KVTransferConfig(kv_role=role, kv_connector_extra_config=extra))  # type: ignore[call-arg]


def _event(connector: TorchP2PConnector, timeout: float = 10.0) -> TransferEvent:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = connector.poll()
        if events:
            (event,) = events
            return event
        time.sleep(0.01)
    raise AssertionError("no event")


def test_a_pull_that_arrives_before_its_publish_waits_for_it() -> None:
    """The engine answers a prefill request once the publish is on its way to the worker, so a decode
    engine's pull can reach the producer first (seen with tensor parallelism on a loaded host): the
    producer waits for the offer. A pull of an offer it has ended fails at once."""
    producer, consumer = _connector("prefill"), _connector("decode")
    theirs, ours = _caches(1), _caches(2)
    try:
        address: dict[str, Any] = producer.start(theirs)
        consumer.start(ours)
        consumer.pull("r", {**address, "transfer_id": "t"}, {"kv": [1, 2]})
        time.sleep(0.3)  # the pull waits at the producer
        producer.publish("t", {"kv": [5, 6]})
        assert _event(consumer) == TransferEvent("r", "pulled", None, {"parts": 1})
        assert _event(producer) == TransferEvent("t", "sent", None, {"parts": 1})
        for mine, src in zip(ours["kv"], theirs["kv"]):
            assert torch.equal(mine[1:3], src[5:7])
        start = time.monotonic()
        consumer.pull("r2", {**address, "transfer_id": "t"}, {"kv": [3, 4]})
        again = _event(consumer)
        assert again.kind == "pulled" and "holds no KV for transfer 't'" in (again.error or "")
        assert time.monotonic() - start < 2.0  # not the grace for an offer still to come
    finally:
        consumer.close()
        producer.close()


def test_pulls_run_side_by_side_on_their_own_connections() -> None:
    """A pull waiting at its producer (for an offer still to come) does not hold up the next pull:
    it runs on a second pull thread, over a connection of its own."""
    producer, consumer = _connector("prefill"), _connector("decode", pull_threads=2)
    theirs, ours = _caches(1), _caches(2)
    try:
        address: dict[str, Any] = producer.start(theirs)
        consumer.start(ours)
        producer.publish("ready", {"kv": [0, 7]})
        consumer.pull("slow", {**address, "transfer_id": "later"}, {"kv": [1]})
        time.sleep(0.1)
        consumer.pull("fast", {**address, "transfer_id": "ready"}, {"kv": [2, 3]})
        # "slow" still waits
        assert _event(consumer, timeout=3.0) == TransferEvent("fast", "pulled", None, {"parts": 1})
        producer.publish("later", {"kv": [4]})
        assert _event(consumer) == TransferEvent("slow", "pulled", None, {"parts": 1})
        for mine, src in zip(ours["kv"], theirs["kv"]):
            assert torch.equal(mine[1:4], src[[4, 0, 7]])
    finally:
        consumer.close()
        producer.close()


def test_a_pull_thread_count_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="pull_threads=0"):
        _connector("decode", pull_threads=0)


def test_an_offer_published_in_parts_arrives_in_parts() -> None:
    """A pull of an offer still growing (a prefill in progress) takes each part as it is published
    and reports success only after the final one; every block lands where it belongs."""
    producer, consumer = _connector("prefill"), _connector("decode")
    theirs, ours = _caches(1), _caches(2)
    before = [t.clone() for t in ours["kv"]]
    try:
        address: dict[str, Any] = producer.start(theirs)
        consumer.start(ours)
        producer.publish_part("t", {"kv": []}, False)
        consumer.pull("r", {**address, "transfer_id": "t"}, {"kv": [1, 2, 3, 4]})
        producer.publish_part("t", {"kv": [5]}, False)
        time.sleep(0.3)
        producer.publish_part("t", {"kv": [0, 7]}, False)
        time.sleep(0.3)
        assert consumer.poll() == []  # not complete before the final part
        producer.publish_part("t", {"kv": [6]}, True)
        assert _event(consumer) == TransferEvent("r", "pulled", None, {"parts": 3})
        assert _event(producer) == TransferEvent("t", "sent", None, {"parts": 3})
        for mine, src, old in zip(ours["kv"], theirs["kv"], before):
            assert torch.equal(mine[1:5], src[[5, 0, 7, 6]])
            assert torch.equal(mine[[0, 5, 6, 7]], old[[0, 5, 6, 7]])  # nothing else written
    finally:
        consumer.close()
        producer.close()


def test_a_growing_offer_withdrawn_mid_pull_fails_the_pull() -> None:
    """Withdrawn after its first part (the prefill request failed): the pull fails with the reason,
    the producer reports the offer's end, later parts go nowhere, and the connection serves on."""
    producer, consumer = _connector("prefill"), _connector("decode")
    theirs, ours = _caches(1), _caches(2)
    try:
        address: dict[str, Any] = producer.start(theirs)
        consumer.start(ours)
        producer.publish_part("t", {"kv": [5]}, False)
        consumer.pull("r", {**address, "transfer_id": "t"}, {"kv": [1, 2]})
        time.sleep(0.3)
        producer.withdraw("t")
        failed = _event(consumer)
        assert failed.kind == "pulled" and "withdrew the offer before its prefill completed" in (failed.error or "")
        ended = _event(producer)
        assert ended.kind == "sent" and ended.error is not None
        producer.publish_part("t", {"kv": [6]}, True)  # too late: ignored
        producer.publish("u", {"kv": [3]})
        consumer.pull("r2", {**address, "transfer_id": "u"}, {"kv": [4]})
        assert _event(consumer) == TransferEvent("r2", "pulled", None, {"parts": 1})
        assert _event(producer) == TransferEvent("u", "sent", None, {"parts": 1})
        assert producer.poll() == []
    finally:
        consumer.close()
        producer.close()


def test_the_offers_bookkeeping_both_connectors_share() -> None:
    """``Offers`` (used by torch_p2p and mooncake): an offer grows part by part, a pull takes it once
    and gets only what is new; after its end its late parts are ignored, and the oldest ended ids are
    forgotten past ``ended_kept``."""
    offers = Offers(ended_kept=2)
    offers.publish_part("a", {"kv": [3]}, False)
    offer = offers.take("a")
    assert offer is not None and offer.busy and offers.take("a") is None  # one pull at a time
    sent: dict[str, int] = {}
    assert offer.next_part(sent) == ({"kv": [3]}, False)
    assert offer.next_part(sent) is None  # nothing new yet
    offers.publish_part("a", {"kv": [4, 5], "idx": [0]}, True)
    assert offer.next_part(sent) == ({"kv": [4, 5], "idx": [0]}, True) and sent == {"kv": 3, "idx": 1}
    assert offers.withdraw("a") is False and offer.withdrawn  # the pull in flight reports the end
    offers.end("a")
    offers.publish_part("a", {"kv": [6]}, True)  # after the end: ignored
    assert offers.take("a") is None and offers.known("a") and not offers.known("b")
    offers.publish("b", {"kv": [1]})
    assert offers.withdraw("b") is True  # idle: the caller ends it
    offers.end("b")
    offers.publish("c", {"kv": []})
    whole = offers.take("c")
    assert whole is not None and whole.next_part({}) == ({"kv": []}, True)  # a whole offer: one final part
    offers.end("c")
    assert [offers.known(t) for t in "abc"] == [False, True, True]  # "a", the oldest, forgotten
    offers.publish("b", {"kv": [2]})  # published again under an ended id
    assert offers.take("b") is not None
