"""The ``torch_p2p`` connector on its own: two connectors in one process over loopback, moving blocks of
small CPU caches; what arrives is compared with the producer's blocks."""

from __future__ import annotations

import importlib.util
import re
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pypto_serving.config import KVTransferConfig
from pypto_serving.kv_connectors import torch_p2p
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


@pytest.mark.parametrize(
    ("requested", "device_type", "expected"),
    [
        ("auto", "cuda", "nccl"),
        ("auto", "npu", "hccl"),
        ("auto", "cpu", "gloo"),
        ("auto", "meta", "gloo"),
        ("gloo", "cpu", "gloo"),
        ("gloo", "cuda", "gloo"),
        ("gloo", "npu", "gloo"),
        ("nccl", "cuda", "nccl"),
        ("hccl", "npu", "hccl"),
    ],
)
def test_the_backend_follows_the_caches_device_or_the_setting(
    monkeypatch: pytest.MonkeyPatch, requested: str, device_type: str, expected: str
) -> None:
    """``auto`` takes the device's own group (gloo for a device without one); an explicit backend that
    can serve the caches is kept (gloo serves any device, staging through host memory)."""
    monkeypatch.setattr(torch_p2p, "_nccl_available", lambda: True)
    monkeypatch.setattr(torch_p2p, "_torch_npu_error", lambda: None)
    assert torch_p2p._select_backend(requested, device_type) == expected


NO_NPU = "ModuleNotFoundError: No module named 'torch_npu'"


@pytest.mark.parametrize(
    ("requested", "device_type", "nccl", "npu_error", "message"),
    [
        ("nccl", "cpu", True, None, "backend='nccl': nccl sends cuda buffers but the KV caches are on cpu"),
        ("nccl", "npu", True, None, "backend='nccl': nccl sends cuda buffers but the KV caches are on npu"),
        ("hccl", "cpu", True, None, "backend='hccl': hccl sends npu buffers but the KV caches are on cpu"),
        ("hccl", "cuda", True, None, "backend='hccl': hccl sends npu buffers but the KV caches are on cuda"),
        ("nccl", "cuda", False, None, "backend='nccl': this torch build has no NCCL"),
        ("auto", "cuda", False, None, "backend='auto' (nccl for caches on cuda): this torch build has no NCCL"),
        ("hccl", "npu", True, NO_NPU, f"backend='hccl': hccl needs torch_npu, which cannot be imported ({NO_NPU})"),
        ("auto", "npu", True, NO_NPU, "backend='auto' (hccl for caches on npu): hccl needs torch_npu"),
    ],
)
def test_a_backend_that_cannot_serve_the_caches_is_refused(
    monkeypatch: pytest.MonkeyPatch, requested: str, device_type: str, nccl: bool, npu_error: str | None, message: str
) -> None:
    """Refused with the key, the value and the reason, never replaced by another backend."""
    monkeypatch.setattr(torch_p2p, "_nccl_available", lambda: nccl)
    monkeypatch.setattr(torch_p2p, "_torch_npu_error", lambda: npu_error)
    with pytest.raises(ValueError, match=re.escape(f"kv_connector_extra_config.{message}")):
        torch_p2p._select_backend(requested, device_type)


def test_an_unknown_backend_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match=re.escape("backend='mpi': give one of auto, gloo, nccl, hccl")):
        _connector("decode", backend="mpi")


def test_start_refuses_a_backend_for_caches_elsewhere_and_leaves_nothing_running() -> None:
    """The caches' device decides at start (meta tensors stand in for caches not on the CPU): the
    refusal comes before any thread or store exists; auto on a device without a group of its own
    takes gloo."""
    meta = {"kv": [torch.empty(8, 2, 4, device="meta")]}
    for backend, caches, where in (("nccl", _caches(1), "cpu"), ("nccl", meta, "meta"), ("hccl", meta, "meta")):
        connector = _connector("prefill", backend=backend)
        with pytest.raises(ValueError, match=re.escape(f"backend={backend!r}: {backend} sends")) as refused:
            connector.start(caches)
        assert f"the KV caches are on {where}" in str(refused.value)
        assert connector._threads == [] and connector._store is None
    auto = _connector("decode")
    try:
        auto.start(meta)
        assert auto.backend == "gloo"
    finally:
        auto.close()


def test_hccl_without_torch_npu_is_refused_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Caches on an NPU (a stand-in: torch has no ``npu`` device without torch_npu) with torch_npu not
    importable here: the real import fails and says so."""
    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu is installed here")
    monkeypatch.setattr(torch_p2p, "_caches_device", lambda caches: SimpleNamespace(type="npu", index=0))
    for backend in ("auto", "hccl"):
        connector = _connector("decode", backend=backend)
        with pytest.raises(ValueError, match=r"hccl needs torch_npu, which cannot be imported \(ModuleNotFound"):
            connector.start(_caches(1))
        assert connector._threads == []


def test_a_device_group_keeps_the_buffers_on_the_caches_device() -> None:
    cuda = torch.device("cuda", 1)
    assert torch_p2p._buffer_device("nccl", cuda) == cuda
    assert torch_p2p._buffer_device("hccl", torch.device("meta")) == torch.device("meta")
    assert torch_p2p._buffer_device("gloo", cuda) == torch.device("cpu")  # gloo stages through host memory


def _simulate_nccl(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """Caches taken for ``cuda:0``, and an NCCL group that is a gloo one with its buffers on the CPU
    (as ``cpu:0``, told apart from the gloo path's ``cpu``). Returns the calls made, in order:
    ``set_device``, the ``nccl`` and ``gloo`` group formations (by rank), the ``buffer`` devices asked
    for, the devices blocks are packed on (``gather``), the devices waited for (``synchronize``)."""
    calls: list[tuple[str, Any]] = []
    gloo, buffer, gather = torch_p2p._gloo_group, torch_p2p._buffer_device, torch_p2p.gather_blocks

    def nccl_group(store: Any, rank: int, timeout: Any) -> Any:
        calls.append(("nccl", rank))
        return gloo(store, rank, timeout)

    def gloo_group(store: Any, rank: int, timeout: Any) -> Any:
        calls.append(("gloo", rank))
        return gloo(store, rank, timeout)

    def buffer_device(backend: str, device: torch.device) -> torch.device:
        calls.append(("buffer", (backend, device)))
        return torch.device("cpu", 0) if backend == "nccl" else buffer(backend, device)

    def gather_blocks(caches: Any, blocks: dict[str, list[int]], device: torch.device | None = None) -> torch.Tensor:
        calls.append(("gather", device))
        return gather(caches, blocks, device)

    monkeypatch.setattr(torch_p2p, "_caches_device", lambda caches: torch.device("cuda", 0))
    monkeypatch.setattr(torch_p2p, "_nccl_available", lambda: True)
    monkeypatch.setattr(torch_p2p, "_set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(torch_p2p, "_synchronize", lambda device: calls.append(("synchronize", device)))
    monkeypatch.setattr(torch_p2p, "_nccl_group", nccl_group)
    monkeypatch.setattr(torch_p2p, "_gloo_group", gloo_group)
    monkeypatch.setattr(torch_p2p, "_buffer_device", buffer_device)
    monkeypatch.setattr(torch_p2p, "gather_blocks", gather_blocks)
    return calls


def test_a_simulated_nccl_group_moves_the_blocks_on_the_caches_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA caches (simulated) take the nccl path on both sides (auto and explicit): each sets its
    device before forming its group, packs and receives on the device the helper names for nccl, and
    never forms a gloo group; the consumer waits for its device before it reports the pull; the bytes
    arrive exactly."""
    calls = _simulate_nccl(monkeypatch)
    producer, consumer = _connector("prefill"), _connector("decode", backend="nccl")
    theirs, ours = _caches(1), _caches(2)
    before = [t.clone() for t in ours["kv"]]
    try:
        address: dict[str, Any] = producer.start(theirs)
        consumer.start(ours)
        assert producer.backend == consumer.backend == "nccl"
        producer.publish("t", {"kv": [5, 0, 7]})
        consumer.pull("r", {**address, "transfer_id": "t"}, {"kv": [1, 2, 3]})
        assert _event(consumer) == TransferEvent("r", "pulled", None, {"parts": 1})
        assert _event(producer) == TransferEvent("t", "sent", None, {"parts": 1})
        for mine, src, old in zip(ours["kv"], theirs["kv"], before):
            assert torch.equal(mine[1:4], src[[5, 0, 7]])
            assert torch.equal(mine[[0, 4, 5, 6, 7]], old[[0, 4, 5, 6, 7]])  # nothing else written
    finally:
        consumer.close()
        producer.close()
    cuda = torch.device("cuda", 0)
    assert calls.count(("buffer", ("nccl", cuda))) == 2  # one per side
    assert [c for c in calls if c[0] == "gather"] == [("gather", torch.device("cpu", 0))]
    assert [c for c in calls if c[0] == "synchronize"] == [("synchronize", cuda)]  # the one pull
    formed = [c for c in calls if c[0] in ("set_device", "nccl", "gloo")]
    assert sorted(formed[1::2]) == [("nccl", 0), ("nccl", 1)]
    assert formed[::2] == [("set_device", cuda)] * 2  # each formation right after its side set the device


def test_a_pull_across_different_backends_fails_at_once_and_leaves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A gloo producer and a (simulated) nccl consumer would form groups that never meet: the pull
    fails at once with both backends named, before the consumer registers a connection, so the
    producer forms no group and the offer stays whole for a consumer on gloo."""
    calls = _simulate_nccl(monkeypatch)
    producer, consumer, other = _connector("prefill", backend="gloo"), _connector("decode"), None
    theirs, ours = _caches(1), _caches(2)
    before = [t.clone() for t in ours["kv"]]
    try:
        address: dict[str, Any] = producer.start(theirs)
        consumer.start(ours)
        producer.publish("t", {"kv": [5]})
        start = time.monotonic()
        consumer.pull("r", {**address, "transfer_id": "t"}, {"kv": [1]})
        failed = _event(consumer)
        assert time.monotonic() - start < 2.0  # not a group formation timing out
        assert failed.kind == "pulled" and failed.error is not None
        assert "connector at 127.0.0.1:" in failed.error and "moves KV over gloo, this decode engine's over nccl: " in (
            failed.error
        )
        assert failed.error.endswith("set kv_connector_extra_config.backend alike on both")
        assert consumer._conns == [{}] and not producer._store.check(["conns"])
        assert not any(c[0] in ("nccl", "gloo", "set_device", "synchronize") for c in calls)  # no group formed
        assert all(torch.equal(mine, old) for mine, old in zip(ours["kv"], before))
        assert producer.poll() == []  # the offer was neither sent nor ended
        other = _connector("decode", backend="gloo")
        other.start(ours)
        other.pull("r2", {**address, "transfer_id": "t"}, {"kv": [1]})
        assert _event(other) == TransferEvent("r2", "pulled", None, {"parts": 1})
        assert _event(producer) == TransferEvent("t", "sent", None, {"parts": 1})
        assert [t.name for t in producer._threads if t.name.startswith("kv-serve")] == ["kv-serve-0"]
        assert all(torch.equal(mine[1], src[5]) for mine, src in zip(ours["kv"], theirs["kv"]))
    finally:
        for connector in (other, consumer, producer):
            if connector is not None:
                connector.close()
