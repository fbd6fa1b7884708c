"""Two ``mooncake`` connectors in this process, a producer and a consumer, over Mooncake's TCP
transport: the bytes a pull writes are exactly the offered blocks' (checked against the core's
``gather_blocks`` of both caches), whether the offer was whole or published in parts while the pull
ran; nothing else changes, and every failure is one event with the reason."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
import torch

from pypto_serving.config import KVTransferConfig
from pypto_serving.kv_transfer import KVCaches, TransferEvent, gather_blocks
from pypto_serving_mooncake_kv import MooncakeConnector

from .conftest import mooncake_engine_missing

_why = mooncake_engine_missing()
pytestmark = pytest.mark.skipif(_why is not None, reason=_why or "")


def _caches(seed: int, swa_dtype: torch.dtype = torch.bfloat16) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, 8, 4, 16, generator=g)  # two layers' views of one allocation
    return {"kv": list(kv.unbind(0)), "swa": [torch.randn(8, 3, generator=g).to(swa_dtype)]}


def _connector(role: str, caches: KVCaches, pull_threads: int = 1) -> tuple[MooncakeConnector, dict[str, object]]:
    extra = {"timeout": 5, "pull_threads": pull_threads}
    cfg = KVTransferConfig(kv_connector="mooncake", kv_role=role, kv_connector_extra_config=extra)
    conn = MooncakeConnector(cfg)
    return conn, conn.start(caches)


def _events(*conns: MooncakeConnector, n: int) -> list[TransferEvent]:
    events: list[TransferEvent] = []
    deadline = time.monotonic() + 10
    while len(events) < n and time.monotonic() < deadline:
        for c in conns:
            events += c.poll()
        time.sleep(0.01)
    return sorted(events, key=lambda e: e.kind)


Producer = tuple[MooncakeConnector, dict[str, list[torch.Tensor]], dict[str, object]]


@pytest.fixture
def producer() -> Iterator[Producer]:
    src = _caches(1)
    conn, address = _connector("prefill", src)
    yield conn, src, address
    conn.close()


def test_a_pull_writes_exactly_the_offered_blocks(producer: Producer) -> None:
    prod, src, address = producer
    dst = _caches(2)
    before = {g: [t.clone() for t in ts] for g, ts in dst.items()}
    cons, _ = _connector("decode", dst)
    try:
        offered, into = {"kv": [1, 2, 3, 7], "swa": [5]}, {"kv": [6, 0, 1, 4], "swa": [2]}
        prod.publish("t1", offered)
        cons.pull("r1", {**address, "transfer_id": "t1"}, into)
        assert _events(prod, cons, n=2) == [
            TransferEvent("r1", "pulled", None, {"parts": 1}),
            TransferEvent("t1", "sent", None, {"parts": 1}),
        ]
        assert torch.equal(gather_blocks(dst, into), gather_blocks(src, offered))
        rest = {g: [b for b in range(8) if b not in into[g]] for g in into}
        assert torch.equal(gather_blocks(dst, rest), gather_blocks(before, rest))  # nothing else written
    finally:
        cons.close()


def test_failures_are_one_event_each_with_the_reason(producer: Producer) -> None:
    prod, _, address = producer
    with socket.create_connection((str(address["remote_host"]), int(str(address["remote_port"])))) as s:
        s.sendall(b"nonsense\n")  # a client breaking the protocol is dropped; the producer serves on
        assert s.recv(16) == b""
    other = _caches(3, swa_dtype=torch.float32)  # another layout
    cons, _ = _connector("decode", other)
    try:
        prod.publish("t1", {"kv": [1], "swa": [1]})
        cons.pull("r1", {**address, "transfer_id": "t1"}, {"kv": [0], "swa": [0]})
        pulled, sent = _events(prod, cons, n=2)
        assert pulled.transfer_id == "r1" and "differ in layout" in (pulled.error or "")
        assert sent.transfer_id == "t1" and "differ in layout" in (sent.error or "")
        cons.pull("r2", {**address, "transfer_id": "t1"}, {"kv": [0], "swa": [0]})  # the offer is gone
        (gone,) = _events(cons, n=1)
        assert "holds no KV" in (gone.error or "")
        prod.publish("t2", {"kv": [1], "swa": [1]})
        prod.withdraw("t2")
        (withdrawn,) = _events(prod, n=1)
        assert withdrawn == TransferEvent("t2", "sent", "withdrawn before a decode engine pulled it")
        cons.pull("r3", {**address, "remote_port": 1, "transfer_id": "t3"}, {"kv": [0], "swa": [0]})
        (refused,) = _events(cons, n=1)
        assert refused.transfer_id == "r3" and "failed" in (refused.error or "")
    finally:
        cons.close()


def _consumer() -> tuple[MooncakeConnector, dict[str, list[torch.Tensor]]]:
    dst = _caches(2)
    cons, _ = _connector("decode", dst)
    return cons, dst


def test_an_offer_published_in_parts_arrives_in_parts(producer: Producer) -> None:
    """A pull of an offer still growing (a prefill in progress) reads each part as it is published
    and reports success only after the final one; every block lands where it belongs."""
    prod, src, address = producer
    cons, dst = _consumer()
    before = {g: [t.clone() for t in ts] for g, ts in dst.items()}
    try:
        prod.publish_part("t", {"kv": [], "swa": []}, False)
        into = {"kv": [1, 2, 3, 4], "swa": [0, 7]}
        cons.pull("r", {**address, "transfer_id": "t", "kv_streamed": True}, into)
        prod.publish_part("t", {"kv": [5]}, False)
        time.sleep(0.3)
        assert cons.poll() == [] and prod.poll() == []  # not complete before the final part
        part = {"kv": [5]}
        assert torch.equal(gather_blocks(dst, {"kv": [1]}), gather_blocks(src, part))  # read as it came
        prod.publish_part("t", {"kv": [0, 7], "swa": [3]}, False)
        time.sleep(0.3)
        assert cons.poll() == []
        prod.publish_part("t", {"kv": [6], "swa": [2]}, True)
        assert _events(prod, cons, n=2) == [
            TransferEvent("r", "pulled", None, {"parts": 3}),
            TransferEvent("t", "sent", None, {"parts": 3}),
        ]
        offered = {"kv": [5, 0, 7, 6], "swa": [3, 2]}
        assert torch.equal(gather_blocks(dst, into), gather_blocks(src, offered))
        rest = {g: [b for b in range(8) if b not in into[g]] for g in into}
        assert torch.equal(gather_blocks(dst, rest), gather_blocks(before, rest))  # nothing else written
    finally:
        cons.close()


def test_a_growing_offer_withdrawn_mid_pull_fails_the_pull(producer: Producer) -> None:
    """Withdrawn after its first part (the prefill request failed): the pull fails with the reason,
    the producer reports the offer's end, later parts go nowhere, and the connection serves on."""
    prod, src, address = producer
    cons, dst = _consumer()
    try:
        prod.publish_part("t", {"kv": [5], "swa": []}, False)
        cons.pull("r", {**address, "transfer_id": "t", "kv_streamed": True}, {"kv": [1, 2], "swa": []})
        time.sleep(0.3)
        prod.withdraw("t")
        pulled, sent = _events(prod, cons, n=2)
        assert pulled.transfer_id == "r" and "withdrew the offer before its prefill completed" in (pulled.error or "")
        assert sent.transfer_id == "t" and sent.error is not None
        prod.publish_part("t", {"kv": [6]}, True)  # too late: ignored
        prod.publish("u", {"kv": [3], "swa": [4]})
        cons.pull("r2", {**address, "transfer_id": "u"}, {"kv": [4], "swa": [5]})
        assert _events(prod, cons, n=2) == [
            TransferEvent("r2", "pulled", None, {"parts": 1}),
            TransferEvent("u", "sent", None, {"parts": 1}),
        ]
        assert torch.equal(gather_blocks(dst, {"kv": [4], "swa": [5]}), gather_blocks(src, {"kv": [3], "swa": [4]}))
        assert prod.poll() == []
    finally:
        cons.close()


def test_a_pull_that_arrives_before_its_publish_waits_for_it(producer: Producer) -> None:
    """The engine answers a request once its publish is on the way to the worker, so a pull can reach
    the producer first: the producer waits for the offer. One it has ended is refused at once."""
    prod, src, address = producer
    cons, dst = _consumer()
    try:
        cons.pull("r", {**address, "transfer_id": "t"}, {"kv": [1], "swa": [1]})
        time.sleep(0.3)  # the pull waits at the producer
        prod.publish("t", {"kv": [6], "swa": [2]})
        assert [e.error for e in _events(prod, cons, n=2)] == [None, None]
        assert torch.equal(gather_blocks(dst, {"kv": [1], "swa": [1]}), gather_blocks(src, {"kv": [6], "swa": [2]}))
        start = time.monotonic()
        cons.pull("r2", {**address, "transfer_id": "t"}, {"kv": [1], "swa": [1]})
        (again,) = _events(cons, n=1)
        assert "holds no KV for transfer 't'" in (again.error or "")
        assert time.monotonic() - start < 2.0  # not the grace for an offer still to come
    finally:
        cons.close()


def test_a_producer_closing_mid_stream_fails_the_pull() -> None:
    """The prefill engine shuts down while an offer still grows: the pull ends with the reason."""
    src = _caches(1)
    prod, address = _connector("prefill", src)
    cons, _ = _connector("decode", _caches(2))
    try:
        prod.publish_part("t", {"kv": [5]}, False)
        cons.pull("r", {**address, "transfer_id": "t", "kv_streamed": True}, {"kv": [1, 2]})
        time.sleep(0.3)
        prod.close()
        (failed,) = _events(cons, n=1)
        assert failed.transfer_id == "r" and "the connector is closing" in (failed.error or ""), failed
    finally:
        cons.close()
        prod.close()


@pytest.mark.parametrize("pull_threads", [1, 2])
def test_a_streamed_pull_holds_only_its_own_pull_thread(producer: Producer, pull_threads: int) -> None:
    """A streamed pull waits on its thread for the prefill's next part: with one pull thread the next
    pull queues behind it, with two it runs meanwhile, over a connection of its own."""
    prod, src, address = producer
    dst = _caches(2)
    cons, _ = _connector("decode", dst, pull_threads=pull_threads)
    try:
        prod.publish_part("streamed", {"kv": [5], "swa": []}, False)
        cons.pull("slow", {**address, "transfer_id": "streamed", "kv_streamed": True}, {"kv": [1, 2], "swa": []})
        time.sleep(0.2)  # "slow" has its first part and waits for the next
        prod.publish("ready", {"kv": [0, 7], "swa": [3]})
        cons.pull("fast", {**address, "transfer_id": "ready"}, {"kv": [3, 4], "swa": [6]})
        fast = TransferEvent("fast", "pulled", None, {"parts": 1})
        if pull_threads == 2:
            assert _events(cons, n=1) == [fast]
        else:
            time.sleep(0.5)
            assert cons.poll() == []  # queued behind "slow"
        prod.publish_part("streamed", {"kv": [6]}, True)
        slow = TransferEvent("slow", "pulled", None, {"parts": 2})
        assert _events(cons, n=1 if pull_threads == 2 else 2) == ([slow] if pull_threads == 2 else [slow, fast])
        assert torch.equal(gather_blocks(dst, {"kv": [1, 2, 3, 4]}), gather_blocks(src, {"kv": [5, 6, 0, 7]}))
        assert torch.equal(gather_blocks(dst, {"swa": [6]}), gather_blocks(src, {"swa": [3]}))
        assert sorted(e.transfer_id for e in _events(prod, n=2)) == ["ready", "streamed"]
    finally:
        cons.close()
