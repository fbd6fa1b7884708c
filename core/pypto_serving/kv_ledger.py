"""Disaggregated prefill and decode: the engine's block bookkeeping of KV transfers, and the worker
thread that drives a :class:`~pypto_serving.kv_transfer.KVConnector`.

Flow (vLLM's disaggregated proxy flow): a request to the prefill engine carries
``kv_transfer_params = {"do_remote_decode": true}`` (usually with ``max_tokens = 1``). It runs as
any request; when it finishes, its blocks covering the first ``prompt - 1`` tokens are *held*
(published to the connector) instead of freed, and its output carries the ``kv_transfer_params`` a
decode engine needs. The same prompt sent to the decode engine with those params *pulls*: the engine
allocates blocks for ``prompt - 1`` tokens, the connector fills them, and only then does the request
enter the scheduler, as a prefix-cache hit of ``prompt - 1`` tokens: the decode engine computes the
last prompt token and samples every output token itself, so sampling (seeds, penalties, stop strings,
logprobs) never crosses engines and the outputs equal co-located serving.

With hit-aligned cache groups (sliding windows, snapshots: :attr:`KVCacheManager.hit_aligned`) a
computation starts only at a multiple of the hit unit, so the transfer covers ``prompt - 1`` rounded
down to it: the prefill side takes that prefix-cache hit on the request's own blocks, each side gives
back the entries a start there never reads, and only held (not FREED) entries move, in table order.
A streamed offer (``stream_kv``) fixes that hit as the request is added and publishes those entries
chunk by chunk, each referenced by the offer itself.

Every block a transfer touches is owned by exactly one record until the connector says it no longer
touches it (a ``sent`` or ``pulled`` event): a held request until ``sent`` (after the pull, a failed
send, or a withdrawal at ``kv_transfer_timeout``), a pulling request until ``pulled``. A failed pull
fails its request with the reason and frees its blocks; it never reaches the scheduler.

With tensor parallelism every rank runs a connector over its own shard of the caches, and
:class:`KVLinks` makes them look like one to the ledger (rank ``r`` pulls from the prefill engine's
rank ``r``; a transfer ends when every rank reported it).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_any
from typing import Any

from .config import KVTransferConfig
from .kv_cache import FREED, KVCacheManager
from .kv_transfer import KVCaches, KVConnector, TransferEvent
from .request import Request, RequestStatus

__all__ = ["TRANSFER_FAILED", "KVLinks", "KVTransferLedger", "prompt_digest", "start_kv_service"]

TRANSFER_FAILED = "KV transfer failed"  # the start of a failed pull's error (the server answers 502)

logger = logging.getLogger(__name__)

Send = Callable[[tuple[Any, ...]], None]


def prompt_digest(ids: list[int]) -> str:
    """Ties a transfer to its prompt: the decode request must send the same tokens."""
    return hashlib.sha256(struct.pack(f"<{len(ids)}q", *ids)).hexdigest()[:32]


@dataclass(slots=True)
class _Held:
    request: Request
    deadline: float
    withdrawn: bool = False
    keep: bool = True  # the request's blocks are held (False: a withdrawn stream's request freed them)
    pinned: dict[str, list[int]] = field(default_factory=dict)  # a stream's parts, referenced apart


@dataclass(slots=True)
class _Stream:
    """A prefill whose offer grows chunk by chunk (``stream_kv``): the blocks published so far, each
    referenced by the offer itself (a preempted or aborted request frees its own references)."""

    request: Request
    transfer_id: str
    num_tokens: int
    published: dict[str, int]
    pinned: dict[str, list[int]]
    ended: bool = False  # the offer ended early (a failed send, a block it needs evicted): nothing more goes out


@dataclass(slots=True)
class _Pull:
    request: Request
    source: dict[str, Any]
    num_tokens: int
    started: bool = False
    aborted: bool = False


class KVTransferLedger:
    """Which blocks each transfer holds, on either side, and when they are freed."""

    def __init__(
        self,
        config: KVTransferConfig,
        kv: KVCacheManager,
        send: Send,
        address: dict[str, Any],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.kv = kv
        self._send = send
        self.address = address
        self._clock = clock
        self.held: dict[str, _Held] = {}  # prefill side, by transfer id
        self.pulls: dict[str, _Pull] = {}  # decode side, by transfer id (the request id)
        # Decode side: how many more requests may hold blocks beside the pulls in flight (the engine:
        # ``max_num_seqs`` less its running and waiting requests). A pull starts only into a seat, as
        # vLLM loads remote KV only for a request it schedules: without it, pulled prompts queued
        # behind a full batch took the pool's free blocks and the running requests were preempted.
        self.seats: Callable[[], int] = lambda: 1 << 30
        self.streams: dict[str, _Stream] = {}  # prefill side, growing offers by transfer id
        self.stats = {
            "kv_sent": 0,
            "kv_send_failed": 0,
            "kv_pulled": 0,
            "kv_pull_failed": 0,
            "kv_parts_sent": 0,
            "kv_parts_pulled": 0,
        }

    # -- checks on add
    def check(self, req: Request, n: int) -> None:
        """Refuse a request whose ``kv_transfer_params`` this engine's role cannot serve."""
        params = req.sampling_params.kv_transfer_params or {}
        role = self.config.kv_role
        if params.get("do_remote_decode") and role not in ("prefill", "both"):
            raise ValueError(
                f"kv_transfer_params.do_remote_decode needs kv_role 'prefill' or 'both' (this engine: {role})"
            )
        if params.get("do_remote_prefill"):
            if role not in ("decode", "both"):
                raise ValueError(
                    f"kv_transfer_params.do_remote_prefill needs kv_role 'decode' or 'both' (this engine: {role})"
                )
            self._check_source(req, params)
            if req.sampling_params.prompt_logprobs is not None:
                raise ValueError("prompt_logprobs needs every prompt token computed here: not with do_remote_prefill")
        if params.get("stream_kv"):
            self._check_stream(params)
        if n != 1 and (params.get("do_remote_decode") or params.get("do_remote_prefill")):
            raise ValueError("kv_transfer_params needs n=1 (one sequence per transferred prompt)")

    def _check_stream(self, params: dict[str, Any]) -> None:
        if not params.get("do_remote_decode"):
            raise ValueError("kv_transfer_params.stream_kv applies to a prefill request (do_remote_decode)")
        if not self.address.get("streams"):
            connector = self.config.kv_connector
            raise ValueError(f"kv_transfer_params.stream_kv: the KV connector {connector!r} cannot stream")

    def _check_source(self, req: Request, params: dict[str, Any]) -> None:
        missing = [
            k for k in ("transfer_id", "remote_host", "remote_port", "num_tokens", "prompt_digest") if k not in params
        ]
        if missing:
            raise ValueError(
                f"kv_transfer_params lacks {', '.join(missing)} (pass the prefill response's kv_transfer_params)"
            )
        if params["prompt_digest"] != prompt_digest(req.prompt_token_ids):
            raise ValueError("kv_transfer_params belong to another prompt: send the decode engine the prefill's prompt")
        n, limit = params["num_tokens"], self.kv.transfer_tokens(req.num_prompt_tokens - 1)
        # A prefill engine whose hit unit aligns transfers may offer less than the limit (window
        # blocks evicted before it held them): any hit position up to it.
        shorter = self.kv.hit_aligned and isinstance(n, int) and 0 <= n < limit and n % self.kv.hit_unit == 0
        if n != limit and not shorter:
            raise ValueError(f"kv_transfer_params.num_tokens={n!r}; this prompt needs {limit}")

    # -- prefill side
    def hold(self, req: Request) -> bool:
        """Called as a request finishes: keep the blocks of a ``do_remote_decode`` request that
        finished normally (published to the connector); False: free them as usual."""
        params = req.sampling_params.kv_transfer_params
        stream = self.streams.pop(f"{req.request_id}@{id(req):x}", None)
        if stream is not None:
            return self._hold_stream(stream)
        if not params or not params.get("do_remote_decode") or req.status is RequestStatus.FINISHED_ERROR:
            return False
        if req.status is RequestStatus.FINISHED_ABORTED:
            return False
        num_tokens, blocks = self._offer(req)
        tid = self._describe(req, num_tokens)
        if not any(blocks.values()):
            return False  # a one-token prompt: nothing to move, the decode engine computes it all
        self.held[tid] = _Held(req, self._clock() + self.config.kv_transfer_timeout)
        self._send(("publish", tid, blocks))
        return True

    def _describe(self, req: Request, num_tokens: int, **more: Any) -> str:
        """Set the request's output ``kv_transfer_params`` (what a decode engine pulls with); returns
        the transfer id."""
        tid = f"{req.request_id}@{id(req):x}"
        req.out.kv_transfer_params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": tid,
            "num_tokens": num_tokens,
            "prompt_digest": prompt_digest(req.prompt_token_ids),
            **more,
            **self.address,
        }
        return tid

    # -- prefill side, streamed (stream_kv): the offer opens as the request is added and grows by the
    # full blocks of each computed prefill chunk; the request's end publishes the rest (or withdraws).
    # With hit-aligned groups the hit is fixed as the offer opens, and only the blocks a start there
    # reads go out, each as soon as a chunk filled it.
    def open_stream(self, req: Request) -> None:
        """Open the growing offer of a ``stream_kv`` request as it is added: its ``kv_transfer_params``
        are final from now on (``EngineCore.kv_transfer_params``), so a decode engine can pull during the prefill."""
        num_tokens = self._stream_tokens(req)
        tid = self._describe(req, num_tokens, kv_streamed=True)
        if num_tokens == 0:
            return  # a one-token prompt: nothing to move
        names = [g.name for g in self.kv.groups]
        self.streams[tid] = _Stream(req, tid, num_tokens, dict.fromkeys(names, 0), {g: [] for g in names})
        self._send(("publish_part", tid, {g: [] for g in names}, False, True))

    def publish_computed(self, requests: list[Request], ends: list[int]) -> None:
        """After a step's result: publish the blocks its prefill chunks filled (request ``i``'s tokens
        before ``ends[i]`` are computed) as the next parts of their streams."""
        for req, end in zip(requests, ends):
            stream = self.streams.get(f"{req.request_id}@{id(req):x}")
            if stream is None or stream.ended:
                continue
            # Only confirmed tokens: a step preempted in flight confirmed nothing, and the blocks the
            # request holds now (if readmitted) are not the ones that step wrote.
            done = min(end, stream.num_tokens, req.sched.confirmed)
            if self.kv.hit_aligned:  # no block of a discarded step is cached either
                part = self._aligned_part(stream, done)
            else:
                part = self._prefix_part(stream, done)
            if part is None:
                self._abandon(stream)
                continue
            self._pin(stream, part)
            if any(part.values()):
                self._send(("publish_part", stream.transfer_id, part, False, False))

    def _stream_tokens(self, req: Request) -> int:
        """The tokens a streamed offer moves, fixed as it opens: ``prompt - 1``, or with hit-aligned
        groups what the whole offer moves while the request's blocks are cached (rounded down to the
        hit unit; nothing without prefix caching, whose cache brings back given-back window blocks)."""
        if not self.kv.hit_aligned:
            return req.num_prompt_tokens - 1
        return self.kv.transfer_tokens(req.num_prompt_tokens - 1) if self.kv.prefix_caching else 0

    def _prefix_part(self, stream: _Stream, done: int) -> dict[str, list[int]]:
        """The full blocks of the first ``done`` tokens not yet published (every group reads them all)."""
        part: dict[str, list[int]] = {}
        for g in self.kv.groups:
            full, table = done // g.tokens_per_block, stream.request.kv.block_ids.get(g.name, [])
            part[g.name] = table[stream.published[g.name] : full]
            stream.published[g.name] += len(part[g.name])
        return part

    def _aligned_part(self, stream: _Stream, done: int) -> dict[str, list[int]] | None:
        """With hit-aligned groups, the blocks a start at the offer's hit reads (per group
        :meth:`KVCacheManager.needed_blocks`: a window's last blocks, a snapshot at the hit, every
        compressed block) that the first ``done`` tokens fill and no part holds yet. A window block
        the request already gave back comes from the prefix cache, where the step that filled it
        published it just before (the window moves on as a step's result is applied, before
        :meth:`publish_computed`); None: one was evicted since, the offer cannot complete."""
        req, part = stream.request, dict[str, list[int]]()
        for g in self.kv.groups:
            need, table = self.kv.needed_blocks(g, stream.num_tokens), req.kv.block_ids.get(g.name, [])
            start = max(need.start, stream.published[g.name])
            end = min(need.stop, done // g.tokens_per_block)
            blocks: list[int] = []
            for i in range(start, end):
                block: int | None = table[i] if i < len(table) and table[i] != FREED else None
                if block is None:
                    key = self.kv.prefix_keys(req, g, end * g.tokens_per_block)[i]
                    block = self.kv.pools[g.name].cached.get(key)
                if block is None:
                    return None
                blocks.append(block)
            part[g.name] = blocks
            stream.published[g.name] = max(start, end)
        return part

    def _pin(self, stream: _Stream, part: dict[str, list[int]]) -> None:
        """The offer's own reference to each block of a part: a preempted request frees its own."""
        for group, blocks in part.items():
            for block in blocks:
                self.kv.pools[group].take_cached(block)
            stream.pinned[group] += blocks

    def _abandon(self, stream: _Stream) -> None:
        """A block the offer needs is gone: withdraw it (the decode engine's pull fails with the
        reason); its parts stay referenced until the connector lets go, and nothing more goes out."""
        stream.ended = True
        held = _Held(stream.request, self._clock(), withdrawn=True, keep=False, pinned=stream.pinned)
        self.held[stream.transfer_id], stream.pinned = held, {}
        self._send(("withdraw", stream.transfer_id))

    def _hold_stream(self, stream: _Stream) -> bool:
        """The streamed request finished: publish its last blocks (or withdraw the offer when it failed
        or was aborted); the pinned parts are freed with the offer's end."""
        req, tid = stream.request, stream.transfer_id
        if stream.ended:
            return False  # the offer ended early; its pinned parts are freed (or held until the connector lets go)
        finished = req.status not in (RequestStatus.FINISHED_ERROR, RequestStatus.FINISHED_ABORTED)
        if finished and self.kv.hit_aligned:
            return self._hold_aligned(stream)
        held = _Held(req, self._clock() + self.config.kv_transfer_timeout, keep=finished, pinned=stream.pinned)
        self.held[tid] = held
        if not finished:
            held.withdrawn = True
            self._send(("withdraw", tid))
            return False
        self._trim(req, stream.num_tokens)
        rest = {g: [b for b in t[stream.published.get(g, 0) :] if b != FREED] for g, t in req.kv.block_ids.items()}
        self._send(("publish_part", tid, rest, True, False))
        return True

    def _hold_aligned(self, stream: _Stream) -> bool:
        """The final part of a hit-aligned stream: the rest of the blocks its hit reads, referenced by
        the offer like the earlier parts, so the request's own blocks are freed as usual (False)."""
        rest = self._aligned_part(stream, stream.num_tokens)
        if rest is None:
            self._abandon(stream)
            return False
        self._pin(stream, rest)
        deadline = self._clock() + self.config.kv_transfer_timeout
        self.held[stream.transfer_id] = _Held(stream.request, deadline, keep=False, pinned=stream.pinned)
        self._send(("publish_part", stream.transfer_id, rest, True, False))
        return False

    def _unpin(self, pinned: dict[str, list[int]]) -> None:
        for group, blocks in pinned.items():
            self.kv.pools[group].release(blocks)
        pinned.clear()

    def pinned(self) -> list[dict[str, list[int]]]:
        """Blocks streamed offers reference apart from their requests (for the KV invariants)."""
        return [s.pinned for s in self.streams.values()] + [h.pinned for h in self.held.values()]

    def _offer(self, req: Request) -> tuple[int, dict[str, list[int]]]:
        """The tokens a decode engine can start after and the blocks it pulls for them (per group,
        the entries a computation from there reads, in order). With hit-aligned groups (sliding
        windows, snapshots) that is a prefix-cache hit on the request's own published blocks: its
        window blocks already given back are taken again from the prefix cache."""
        if not self.kv.hit_aligned:
            num_tokens = req.num_prompt_tokens - 1
            return num_tokens, self._trim(req, num_tokens)
        limit = self.kv.transfer_tokens(req.num_prompt_tokens - 1)
        self.kv.free(req)
        num_tokens = self.kv.take_prefix(req, limit)[0] if self.kv.prefix_caching else 0
        return num_tokens, _held_blocks(req)

    def _trim(self, req: Request, num_tokens: int) -> dict[str, list[int]]:
        """Free the blocks past the first ``num_tokens`` tokens; the rest is what a decode engine pulls."""
        kept: dict[str, list[int]] = {}
        for g in self.kv.groups:
            table = req.kv.block_ids.get(g.name, [])
            n = self.kv.blocks_needed(g, num_tokens)
            extra = [b for b in table[n:] if b != FREED]
            self.kv.pools[g.name].release(extra)
            del table[n:]
            kept[g.name] = list(table)
        return kept

    # -- decode side
    def start_pull(self, req: Request) -> bool:
        """Begin a ``do_remote_prefill`` request; False when there is nothing to pull (it goes to the
        scheduler at once)."""
        params = dict(req.sampling_params.kv_transfer_params or {})
        if int(params["num_tokens"]) == 0:
            return False
        self.pulls[req.request_id] = _Pull(req, params, int(params["num_tokens"]))
        self._start_waiting()
        return True

    def _start_waiting(self) -> None:
        """Start waiting pulls in arrival order while seats (:attr:`seats`) last; one without room in
        the pool waits for a later tick."""
        if not self.pulls:
            return
        free = self.seats() - sum(p.started for p in self.pulls.values())
        for pull in self.pulls.values():
            if free <= 0:
                return
            if not pull.started and self._try_start(pull):
                free -= 1

    def _try_start(self, pull: _Pull) -> bool:
        """Allocate the blocks and ask the connector; False without room in the pool."""
        if not self.kv.allocate(pull.request, pull.num_tokens):
            return False
        pull.started = True
        self.kv.restrict_to_hit(pull.request, pull.num_tokens)
        # A hit's blocks: a group whose entries are shifted past the positions (an MTP window) holds
        # one more block than the prefill engine offers, which the decode engine computes itself.
        hit = self.kv.hit_aligned
        blocks = self.kv.blocks_before(pull.request, pull.num_tokens) if hit else _held_blocks(pull.request)
        self._send(("pull", pull.request.request_id, pull.source, blocks))
        return True

    def abort(self, request_id: str) -> Request | None:
        """Abort a pulling request: at once when its pull has not started (returned, finished);
        otherwise when the connector reports the pull's end."""
        pull = self.pulls.get(request_id)
        if pull is None:
            return None
        if pull.started:
            pull.aborted = True
            return None
        del self.pulls[request_id]
        _finish(pull.request, RequestStatus.FINISHED_ABORTED, None)
        return pull.request

    # -- events
    def tick(self) -> None:
        """Withdraw held blocks past their deadline; start pulls that now have a seat and room."""
        now = self._clock()
        for tid, held in self.held.items():
            if not held.withdrawn and now > held.deadline:
                held.withdrawn = True
                self._send(("withdraw", tid))
        self._start_waiting()

    def on_event(self, event: TransferEvent) -> tuple[Request | None, bool]:
        """Apply one connector event; returns a decode request whose pull ended (or None) and whether
        it succeeded (it may compute)."""
        if event.kind == "sent":
            self._on_sent(event)
            return None, False
        pull = self.pulls.pop(event.transfer_id, None)
        if pull is None:
            return None, False
        req = pull.request
        if event.error is not None or pull.aborted:
            self.stats["kv_pull_failed"] += event.error is not None
            self.kv.free(req)
            status = RequestStatus.FINISHED_ABORTED if pull.aborted else RequestStatus.FINISHED_ERROR
            _finish(req, status, None if pull.aborted else f"{TRANSFER_FAILED}: {event.error}")
            return req, False
        self.stats["kv_pulled"] += 1
        self.stats["kv_parts_pulled"] += int((event.detail or {}).get("parts", 1))  # a whole offer: one part
        return req, True

    def _on_sent(self, event: TransferEvent) -> None:
        """A producer's offer ended: free what it held (a stream still computing stops publishing)."""
        held = self.held.pop(event.transfer_id, None)
        stream = self.streams.get(event.transfer_id)
        if held is None and stream is None:
            return
        self.stats["kv_sent" if event.error is None else "kv_send_failed"] += 1
        self.stats["kv_parts_sent"] += int((event.detail or {}).get("parts", 1)) if event.error is None else 0
        if event.error is not None:
            logger.warning("KV transfer %s not completed: %s", event.transfer_id, event.error)
        if stream is not None:
            stream.ended = True  # the request runs on, publishing nothing more
            self._unpin(stream.pinned)
        if held is not None:
            if held.keep:
                self.kv.free(held.request)
            self._unpin(held.pinned)

    def fail_pulls(self, reason: str) -> list[Request]:
        """The engine died: every pulling request fails (the worker and its blocks are gone)."""
        failed = [p.request for p in self.pulls.values()]
        for req in failed:
            _finish(req, RequestStatus.FINISHED_ERROR, reason)
        self.pulls.clear()
        return failed

    def owners(self) -> list[Request]:
        """Requests holding blocks outside the scheduler (for the KV invariants)."""
        return [h.request for h in self.held.values() if h.keep] + [p.request for p in self.pulls.values()]


def _held_blocks(req: Request) -> dict[str, list[int]]:
    """Per group, the blocks a request holds in table order (FREED entries move nothing)."""
    return {g: [b for b in table if b != FREED] for g, table in req.kv.block_ids.items()}


def _finish(req: Request, status: RequestStatus, error: str | None) -> None:
    req.status = status
    req.error = error
    req.metrics.finished_time = time.monotonic()


# ---------------------------------------------------------------------- the engine's links
@dataclass(slots=True)
class _Tally:
    """The ranks still to report a transfer's end, and the first error one reported."""

    left: int
    error: str | None = None


class KVLinks:
    """The engine process's side of the worker's KV connectors, one pipe per tensor-parallel rank.

    Each rank holds a shard of every cache group and runs its own connector over it; rank ``r`` of a
    decode engine pulls from rank ``r`` of the prefill engine. To the ledger the ranks look like one
    connector: every message goes to every rank, and a transfer ends when every rank has reported it
    (with the first error any rank reported), since until then some rank may still read or write its
    blocks. A pull from a prefill engine of another ``tensor_parallel_size`` fails here, unsent."""

    def __init__(self, conns: list[Connection]) -> None:
        self.conns = conns
        self._tally: dict[tuple[str, str], _Tally] = {}
        self._refused: list[TransferEvent] = []  # pulls failed here, reported by the next events()

    def start(self, timeout: float) -> dict[str, Any]:
        """The connectors' address: rank 0's, and with several ranks every rank's under ``ranks``
        (a decode engine's rank ``r`` pulls from ``ranks[r]``)."""
        addresses = []
        for rank, conn in enumerate(self.conns):
            if not conn.poll(timeout):
                raise RuntimeError(f"the KV connector of worker rank {rank} did not start within {timeout:.0f}s")
            kind, address = conn.recv()
            assert kind == "address", kind
            addresses.append(address)
        return addresses[0] if len(addresses) == 1 else {**addresses[0], "ranks": addresses}

    def send(self, msg: tuple[Any, ...]) -> None:
        """Pass a ledger message (publish, withdraw, pull, close) to every rank."""
        kind, n = msg[0], len(self.conns)
        if kind == "pull":
            problem = self._mismatch(msg[2])
            if problem is not None:
                self._refused.append(TransferEvent(msg[1], "pulled", problem))
                return
            self._tally[("pulled", msg[1])] = _Tally(n)
            for rank, conn in enumerate(self.conns):
                conn.send(("pull", msg[1], _rank_source(msg[2], rank, n), msg[3]))
            return
        if kind == "publish" or (kind == "publish_part" and msg[4]):  # a whole offer, or a growing one's opening
            self._tally[("sent", msg[1])] = _Tally(n)
            msg = msg[:4]
        for conn in self.conns:
            conn.send(msg)

    def _mismatch(self, source: dict[str, Any]) -> str | None:
        ranks = source.get("ranks", [source])
        if not isinstance(ranks, list) or not all(isinstance(r, dict) for r in ranks):
            return "kv_transfer_params.ranks is not a list of the prefill engine's rank addresses"
        if len(ranks) != len(self.conns):
            return (
                f"the prefill engine runs tensor_parallel_size={len(ranks)} and this decode engine "
                f"{len(self.conns)}: the KV moves rank to rank, so both need the same tensor_parallel_size"
            )
        return None

    def events(self, wait: float) -> list[TransferEvent]:
        """The transfers every rank has reported the end of, waiting up to ``wait`` seconds for a
        first rank's event when none is due. :raises EOFError, OSError: a rank's pipe closed."""
        ended, self._refused = self._refused, []
        for conn in wait_any(self.conns, timeout=0.0 if ended else wait):
            assert isinstance(conn, Connection)
            while conn.poll():
                event = self._tallied(conn.recv(), self.conns.index(conn))
                if event is not None:
                    ended.append(event)
        return ended

    def _tallied(self, event: TransferEvent, rank: int) -> TransferEvent | None:
        key = (event.kind, event.transfer_id)
        tally = self._tally.get(key)
        if tally is None:
            return event  # not one the ledger started: it ignores it
        tally.left -= 1
        if tally.error is None and event.error is not None:
            tally.error = event.error if len(self.conns) == 1 else f"rank {rank}: {event.error}"
        if tally.left:
            return None
        del self._tally[key]
        return TransferEvent(event.transfer_id, event.kind, tally.error, event.detail)

    def close(self) -> None:
        """Stop every rank's connector (transfers in flight end with an error)."""
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(("close",))


def _rank_source(source: dict[str, Any], rank: int, n: int) -> dict[str, Any]:
    """The offer as rank ``rank`` of ``n`` pulls it: from the prefill engine's rank of the same index."""
    return source if n == 1 else {**source, **source["ranks"][rank]}


# ---------------------------------------------------------------------- worker side
def start_kv_service(connector: KVConnector, caches: KVCaches, conn: Connection) -> threading.Thread:
    """Start the connector on ``caches`` and a thread relaying the engine's messages to it and its
    events back; the first message sent is the connector's address."""
    conn.send(("address", connector.start(caches)))
    thread = threading.Thread(target=_relay, args=(connector, conn), name="kv-service", daemon=True)
    thread.start()
    return thread


def _relay(connector: KVConnector, conn: Connection) -> None:
    try:
        while True:
            while conn.poll(0.002):
                msg = conn.recv()
                if msg[0] == "close":
                    return
                _dispatch(connector, msg)
            for event in connector.poll():
                conn.send(event)
    except (EOFError, OSError):
        return  # the engine is gone
    finally:
        connector.close()


def _dispatch(connector: KVConnector, msg: tuple[Any, ...]) -> None:
    kind = msg[0]
    if kind == "publish":
        connector.publish(msg[1], msg[2])
    elif kind == "publish_part":
        connector.publish_part(msg[1], msg[2], msg[3])
    elif kind == "withdraw":
        connector.withdraw(msg[1])
    elif kind == "pull":
        connector.pull(msg[1], msg[2], msg[3])
    else:
        connector.message(msg)
