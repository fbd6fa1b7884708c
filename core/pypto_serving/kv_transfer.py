"""The KV-transfer contract: a :class:`KVConnector` moves the blocks of a request's cache groups
between engines (disaggregated prefill and decode), and later between an engine and a slower tier.

A connector lives in the worker process, beside the executor's caches, and every call the core makes
on it returns at once: the work runs on the connector's own threads (or transfer engine), and its
outcome comes back as a :class:`TransferEvent` from :meth:`KVConnector.poll`. The core's side of a
transfer is block bookkeeping only (:mod:`pypto_serving.kv_ledger`): it hands the connector block ids
it holds, and frees them only once an event says the connector no longer touches them.

The two halves of a transfer:

* **Producer** (``kv_role = "prefill"``): :meth:`KVConnector.publish` offers the blocks of a finished
  prefill under a transfer id; the connector sends them to whichever consumer asks for that id, then
  reports ``sent`` (with or without an error). :meth:`KVConnector.withdraw` takes an offer back (a
  timeout, or shutdown); a send in flight ends first; ``sent`` follows either way. A connector whose
  :attr:`KVConnector.streams` is True also takes an offer that grows (:meth:`KVConnector.publish_part`:
  the blocks of each prefill chunk as it is computed) and sends it in parts while it grows.
* **Consumer** (``kv_role = "decode"``): :meth:`KVConnector.pull` fills blocks the engine allocated
  from a producer's offer, described by the ``source`` the producer's response carried; ``pulled``
  follows, and only a ``pulled`` without an error lets the request compute on those blocks.

Every group of :attr:`pypto_serving.ExecutorInfo.cache_groups` is moved the same way: the executor
names the tensors of each group (:meth:`pypto_serving.Executor.kv_cache_blocks`), each indexed by
block id on its first dimension; :func:`gather_blocks` and :func:`scatter_blocks` pack and unpack them.
"""

from __future__ import annotations

import abc
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from .config import KVTransferConfig

if TYPE_CHECKING:
    import torch

__all__ = [
    "KVCaches",
    "KVConnector",
    "KVConnectorFactory",
    "KVTransferConfig",
    "Offer",
    "Offers",
    "TransferEvent",
    "blocks_nbytes",
    "gather_blocks",
    "layout_digest",
    "scatter_blocks",
]

KVCaches = Mapping[str, Sequence["torch.Tensor"]]
"""Per cache group name, the tensors holding its blocks, each with the block id on dimension 0."""


@dataclass(frozen=True, slots=True)
class TransferEvent:
    """The outcome of one transfer, as :meth:`KVConnector.poll` reports it.

    :param transfer_id: the id given to :meth:`KVConnector.publish` or :meth:`KVConnector.pull`.
    :param kind: ``sent``: a producer no longer reads the published blocks (sent, failed, or
        withdrawn): the engine may free them. ``pulled``: a consumer no longer writes the blocks it was
        given; with ``error`` None they hold the source's KV in full.
    :param error: why the transfer failed; None when it succeeded.
    :param detail: what a connector adds for its ledger (the offload tiers: bytes moved, and how
        much of a failed load arrived intact; ``torch_p2p``: ``parts``, the parts an offer moved in).
    """

    transfer_id: str
    kind: Literal["sent", "pulled"]
    error: str | None = None
    detail: dict[str, Any] | None = None


class KVConnector(abc.ABC):
    """Moves KV blocks between engines (or tiers). Lives in the worker process; no call blocks."""

    streams: ClassVar[bool] = False
    """Whether :meth:`publish_part` works: an offer published in parts, pulled while it grows."""

    @abc.abstractmethod
    def start(self, caches: KVCaches) -> dict[str, Any]:
        """Take the executor's cache tensors (after ``init_kv_cache``) and start serving.

        :param caches: per cache group, its tensors, each indexed by block id on dimension 0.
        :return: where peers reach this connector (JSON-serialisable), copied into the
            ``kv_transfer_params`` of every published transfer; ``{}`` for a consumer.
        """

    @abc.abstractmethod
    def publish(self, transfer_id: str, blocks: dict[str, list[int]]) -> None:
        """Producer: offer ``blocks`` (per group, in sequence order) under ``transfer_id`` until a
        consumer pulls them or :meth:`withdraw`; a ``sent`` event ends the offer."""

    def publish_part(self, transfer_id: str, blocks: dict[str, list[int]], final: bool) -> None:
        """Producer (when :attr:`streams`): add ``blocks`` (per group, the next ones in sequence order)
        to the offer ``transfer_id``, opening it on the first call; ``final``: the offer is complete.
        A consumer may pull an open offer: it receives the parts as they come, and its ``pulled``
        event reports success only after the final part arrived. :meth:`withdraw` ends an open offer
        (a pull in progress fails); parts after an offer ended are ignored."""
        raise NotImplementedError(f"{type(self).__name__} publishes whole offers only")

    @abc.abstractmethod
    def withdraw(self, transfer_id: str) -> None:
        """Producer: end the offer; a send in flight finishes (or fails) first. A ``sent`` event
        follows unless one was already reported; unknown ids are ignored."""

    @abc.abstractmethod
    def pull(self, transfer_id: str, source: dict[str, Any], blocks: dict[str, list[int]]) -> None:
        """Consumer: copy the offer ``source`` describes into ``blocks`` (per group, paired in order
        with the offer's); a ``pulled`` event follows.

        :param transfer_id: this pull's id, which its event carries (the consumer's request id).
        :param source: the producer's ``kv_transfer_params``: its :meth:`start` address, and the
            offer's ``transfer_id`` (the id it was published under).
        """

    @abc.abstractmethod
    def poll(self) -> list[TransferEvent]:
        """The transfers that ended since the last call."""

    def message(self, msg: tuple[Any, ...]) -> None:
        """A message of a connector's own protocol (the offload tiers' stores and moves), relayed
        in order with the others."""
        raise NotImplementedError(f"{type(self).__name__} takes no {msg[0]!r} message")

    def close(self) -> None:  # noqa: B027 - optional hook
        """Stop threads and drop connections; transfers in flight end with an error."""


KVConnectorFactory = Callable[[KVTransferConfig], KVConnector]
"""``factory(config) -> KVConnector``, called once in the worker process (a module-level function)."""


@dataclass(slots=True)
class Offer:
    """One offer a producer holds (see :class:`Offers`).

    :param blocks: per group, the block ids published so far, in sequence order.
    :param busy: a consumer is pulling it (the connector sets it when a pull takes the offer).
    :param final: complete; False while a :meth:`KVConnector.publish_part` offer still grows.
    :param withdrawn: :meth:`KVConnector.withdraw` came during the pull: the pull reports the end.
    """

    blocks: dict[str, list[int]] = field(default_factory=dict)
    busy: bool = False
    final: bool = True
    withdrawn: bool = False

    def next_part(self, sent: dict[str, int]) -> tuple[dict[str, list[int]], bool] | None:
        """The blocks published since the last part (``sent``: the blocks sent per group, advanced
        here) and whether the offer is now complete; None while an open offer has nothing new."""
        new = {g: b[sent.get(g, 0) :] for g, b in self.blocks.items()}
        if not self.final and not any(new.values()):
            return None
        for g, b in new.items():
            sent[g] = sent.get(g, 0) + len(b)
        return new, self.final


class Offers:
    """A producer connector's offers by transfer id, the bookkeeping of :meth:`KVConnector.publish`,
    :meth:`KVConnector.publish_part` and :meth:`KVConnector.withdraw`: an offer grows part by part,
    and once it ended (sent, failed or withdrawn) its id is remembered (the newest ``ended_kept``), so
    its late parts are ignored and its pulls refused at once. Not locked: the connector calls it under
    its own lock, beside its events."""

    def __init__(self, ended_kept: int = 4096) -> None:
        self._offers: dict[str, Offer] = {}
        self._ended: dict[str, None] = {}  # oldest first
        self._ended_kept = ended_kept

    def publish(self, transfer_id: str, blocks: dict[str, list[int]]) -> None:
        """A whole offer (a new one under an ended id too: the engine published it again)."""
        self._offers[transfer_id] = Offer({g: list(b) for g, b in blocks.items()})
        self._ended.pop(transfer_id, None)

    def publish_part(self, transfer_id: str, blocks: dict[str, list[int]], final: bool) -> None:
        """Grow the offer (the first part opens it); ignored once the offer ended."""
        offer = self._offers.get(transfer_id)
        if offer is None:
            if transfer_id in self._ended:
                return  # withdrawn, or failed: the prefill's later parts go nowhere
            offer = self._offers[transfer_id] = Offer(final=False)
        for group, ids in blocks.items():
            offer.blocks.setdefault(group, []).extend(ids)
        offer.final = final

    def withdraw(self, transfer_id: str) -> bool:
        """True: no pull holds the offer: the caller ends it (:meth:`end`) and reports its ``sent``;
        False: it is unknown, or a pull holds it (marked ``withdrawn``: that pull reports the end)."""
        offer = self._offers.get(transfer_id)
        if offer is None:
            return False
        if offer.busy:
            offer.withdrawn = True
            return False
        return True

    def take(self, transfer_id: str) -> Offer | None:
        """The offer, now marked busy; None when it is unknown, ended, or busy."""
        offer = self._offers.get(transfer_id)
        if offer is None or offer.busy:
            return None
        offer.busy = True
        return offer

    def known(self, transfer_id: str) -> bool:
        """Published, or ended: a pull that finds no offer to take need not wait for it."""
        return transfer_id in self._offers or transfer_id in self._ended

    def end(self, transfer_id: str) -> None:
        """Drop the offer and remember that it ended."""
        del self._offers[transfer_id]
        self._ended[transfer_id] = None
        if len(self._ended) > self._ended_kept:
            del self._ended[next(iter(self._ended))]


def layout_digest(caches: KVCaches, blocks: dict[str, list[int]] | None = None) -> str:
    """A digest of the per-block shape and dtype of every cache tensor: two engines can exchange
    blocks only when theirs are equal."""
    desc = {g: [(list(t.shape[1:]), str(t.dtype)) for t in ts] for g, ts in sorted(caches.items())}
    return hashlib.sha256(json.dumps(desc).encode()).hexdigest()[:16]


def blocks_nbytes(caches: KVCaches, blocks: dict[str, list[int]]) -> int:
    """Bytes :func:`gather_blocks` packs for ``blocks``."""
    total = 0
    for group, ids in blocks.items():
        for t in caches[group]:
            total += len(ids) * t[0].numel() * t.element_size()
    return total


def gather_blocks(caches: KVCaches, blocks: dict[str, list[int]], device: torch.device | None = None) -> torch.Tensor:
    """``blocks`` of every tensor, packed into one flat uint8 tensor (groups in sorted order, then
    tensors, then blocks), on ``device`` (default: the caches')."""
    import torch

    parts = []
    for group in sorted(blocks):
        ids = blocks[group]
        for t in caches[group]:
            index = torch.tensor(ids, dtype=torch.long, device=t.device)
            parts.append(t.index_select(0, index).reshape(-1).view(torch.uint8))
    flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return flat if device is None else flat.to(device)


def scatter_blocks(caches: KVCaches, blocks: dict[str, list[int]], flat: torch.Tensor) -> None:
    """Write a :func:`gather_blocks` buffer into ``blocks`` (the same groups and counts)."""
    import torch

    at = 0
    for group in sorted(blocks):
        ids = blocks[group]
        for t in caches[group]:
            n = len(ids) * t[0].numel() * t.element_size()
            part = flat[at : at + n].to(t.device).view(t.dtype).view(len(ids), *t.shape[1:])
            t.index_copy_(0, torch.tensor(ids, dtype=torch.long, device=t.device), part)
            at += n
    if at != flat.numel():
        raise ValueError(f"KV buffer of {flat.numel()} bytes for blocks of {at} bytes")
