"""Which replica a request goes to: session affinity, then prefix ownership, then least outstanding tokens.

Everything here is pure bookkeeping on the router's event loop (no I/O, no locks):

* :func:`request_profile` reads what routing needs from a request body: the estimated token cost
  (prompt + ``max_tokens``, times ``n``) and the chain of hashes of the prompt's leading blocks.
* :class:`Router` picks among the replicas that take requests (healthy and not drained):

  1. a request with a session id goes to the replica that ranks first for that id under rendezvous
     (highest-random-weight) hashing among those replicas. Each (session, replica) pair has its own
     score, so a replica leaving moves only its own sessions, and every other session keeps its
     replica; one coming back gets exactly its sessions back.
  2. else a request whose leading blocks an earlier request shared goes to the replica that served
     the longest shared chain (its prefix cache holds those blocks), unless that replica's outstanding
     tokens exceed ``prefix_overload_factor`` x the least loaded one's + ``prefix_overload_tokens``;
  3. else the replica with the fewest outstanding tokens (ties: fewest requests in flight, then in turn).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .config import RouterSettings

__all__ = ["Choice", "ReplicaLoad", "RequestProfile", "Router", "rendezvous_order", "request_profile"]


@dataclass(slots=True)
class ReplicaLoad:
    """What routing knows of one replica: whether it takes requests, and its load."""

    name: str
    healthy: bool = False
    drained: bool = False
    outstanding_tokens: int = 0
    in_flight: int = 0

    @property
    def routable(self) -> bool:
        return self.healthy and not self.drained


@dataclass(frozen=True, slots=True)
class RequestProfile:
    """What routing reads from one request."""

    cost: int  # estimated tokens: prompt + output budget, times the number of choices
    block_hashes: tuple[bytes, ...] = ()  # chained hashes of the prompt's leading complete blocks
    session: str | None = None


@dataclass(frozen=True, slots=True)
class Choice:
    """A routing decision and why it was made (``reason``: session, prefix, least_tokens)."""

    replica: str
    reason: str
    # session: whether the session's first-ranked replica among all configured ones took it;
    # prefix: whether the owner of the longest shared prefix took it (None: nothing was shared).
    hit: bool | None = None
    overloaded: bool = False


def rendezvous_order(key: str, names: Sequence[str]) -> list[str]:
    """``names`` from the highest (key, name) score down: the session's replica, then its fallbacks."""

    def score(name: str) -> bytes:
        return hashlib.blake2b(f"{key}\x00{name}".encode(), digest_size=8).digest()

    return sorted(names, key=score, reverse=True)


def _prompt_blocks(body: dict[str, Any], settings: RouterSettings) -> list[bytes]:
    """The prompt's leading blocks: a chat's messages (each one block, so every turn's blocks extend
    the previous turn's), a text prompt's ``prefix_block_chars``-character pieces, or a token-id
    prompt's ``prefix_block_tokens``-id pieces; only whole pieces, as only whole KV blocks are cached."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return [
            f"{m.get('role', '')}\x00{_content_text(m.get('content'))}".encode()
            for m in messages
            if isinstance(m, dict)
        ]
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch of prompts routes by its first
    if isinstance(prompt, str):
        size = settings.prefix_block_chars
        return [prompt[i : i + size].encode() for i in range(0, len(prompt) - size + 1, size)]
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        size = settings.prefix_block_tokens
        return [",".join(map(str, prompt[i : i + size])).encode() for i in range(0, len(prompt) - size + 1, size)]
    return []


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: the text ones count
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def _prompt_tokens(body: dict[str, Any], chars_per_token: float) -> int:
    """Estimated prompt tokens of every prompt in the request (no tokenizer: characters / ratio)."""
    prompt = body.get("prompt", body.get("messages"))
    items = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
    total = 0
    for item in items:
        if isinstance(item, str):
            total += int(len(item) / chars_per_token) + 1
        elif isinstance(item, list) and all(isinstance(t, int) for t in item):
            total += len(item)
        elif isinstance(item, dict):  # a chat message
            total += int(len(_content_text(item.get("content"))) / chars_per_token) + 4
    return total


def chain_hashes(blocks: list[bytes], settings: RouterSettings, model: str = "") -> tuple[bytes, ...]:
    """Chained hashes of the leading blocks: each hash covers its block and every block before it, and
    starts from the request's ``model`` (a LoRA adapter's KV differs from the base model's, so a
    prefix shared under another adapter is no prefix-cache hit)."""
    out: list[bytes] = []
    parent = hashlib.blake2b(model.encode(), digest_size=16).digest() if model else b""
    for block in blocks[: settings.prefix_max_blocks]:
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        out.append(parent)
    return tuple(out)


def request_profile(body: Any, session: str | None, settings: RouterSettings) -> RequestProfile:
    """Cost and prefix of a request body (any JSON; what is not a generation request costs 1)."""
    if not isinstance(body, dict):
        return RequestProfile(cost=1, session=session)
    budget = body.get("max_completion_tokens", body.get("max_tokens"))
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
        budget = settings.default_max_tokens
    n = body.get("n")
    n = n if isinstance(n, int) and not isinstance(n, bool) and 0 < n <= 1024 else 1
    cost = (_prompt_tokens(body, settings.chars_per_token) + budget) * n
    model = body.get("model")
    name = model if isinstance(model, str) else ""
    hashes = chain_hashes(_prompt_blocks(body, settings), settings, name) if settings.prefix_routing else ()
    return RequestProfile(cost=max(1, cost), block_hashes=hashes, session=session)


@dataclass(slots=True)
class Router:
    """The routing state: each replica's load and the table of block hashes to the replica served."""

    settings: RouterSettings
    replicas: dict[str, ReplicaLoad] = field(default_factory=dict)
    _prefix_owner: OrderedDict[bytes, str] = field(default_factory=OrderedDict)
    _turn: int = 0

    def choose(self, profile: RequestProfile, exclude: Sequence[str] = ()) -> Choice | None:
        """The replica for a request, or None when no replica takes requests."""
        open_ = [r for r in self.replicas.values() if r.routable and r.name not in exclude]
        if not open_:
            return None
        if profile.session:
            first = rendezvous_order(profile.session, [r.name for r in open_])[0]
            preferred = rendezvous_order(profile.session, list(self.replicas))[0]
            return Choice(first, "session", hit=first == preferred)
        least = self._least_loaded(open_)
        owner = self._prefix_match(profile.block_hashes)
        if owner is None:
            return Choice(least.name, "least_tokens")
        candidate = self.replicas.get(owner)
        if candidate is None or candidate not in open_:
            return Choice(least.name, "prefix", hit=False)
        bound = self.settings.prefix_overload_factor * least.outstanding_tokens + self.settings.prefix_overload_tokens
        if candidate.outstanding_tokens > bound:
            return Choice(least.name, "prefix", hit=False, overloaded=True)
        return Choice(owner, "prefix", hit=True)

    def _least_loaded(self, open_: list[ReplicaLoad]) -> ReplicaLoad:
        self._turn += 1
        n = len(open_)
        # Ties rotate, so idle replicas share sequential small requests instead of the first taking all.
        return min((open_[(i + self._turn) % n] for i in range(n)), key=lambda r: (r.outstanding_tokens, r.in_flight))

    def _prefix_match(self, hashes: tuple[bytes, ...]) -> str | None:
        """The replica that served the longest chain of these block hashes, if any did."""
        for h in reversed(hashes):
            owner = self._prefix_owner.get(h)
            if owner is not None:
                return owner
        return None

    def started(self, name: str, profile: RequestProfile) -> None:
        """A request went to ``name``: count its load, and its blocks now live there."""
        load = self.replicas[name]
        load.outstanding_tokens += profile.cost
        load.in_flight += 1
        table = self._prefix_owner
        for h in profile.block_hashes:
            table[h] = name
            table.move_to_end(h)
        while len(table) > self.settings.prefix_table_size:
            table.popitem(last=False)

    def finished(self, name: str, profile: RequestProfile) -> None:
        load = self.replicas.get(name)
        if load is not None:
            load.outstanding_tokens -= profile.cost
            load.in_flight -= 1
