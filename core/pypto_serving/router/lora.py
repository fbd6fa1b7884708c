"""Run-time LoRA adapters across the router's replicas: ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (vLLM's names and bodies) reach every replica, since a request naming an
adapter may be routed to any of them.

* A **load** goes to every healthy replica at once; it succeeds when each one loaded the adapter.
  When one refuses (or cannot be reached), the replicas that did load it unload it again and the
  client gets that replica's answer (a 4xx as the replica gave it, 502 for an unreachable one):
  every replica serves the adapter or none does.
* An **unload** goes to every healthy replica; it succeeds when at least one replica had the adapter
  and none failed otherwise (a replica that never had it answers 404, which is not a failure then).
* The router remembers the adapters it loaded. An unhealthy replica (down, restarting) misses the
  broadcast, so the poll that finds it healthy again first brings its adapters in line (loads what
  it lacks, unloads what was unloaded meanwhile) and only then lets it take requests; a replica that
  refuses keeps out of routing, with the reason in ``/router/replicas``.

The replica's LoRA routes take its admin key (``admin_api_key`` of its entry, sent as Bearer), not
the API key; the router's own routes take the router's ``admin_token``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field

import httpx
from starlette.responses import PlainTextResponse, Response

from .proxy import error_response
from .replicas import Replica

__all__ = ["LORA_PATHS", "LoraBroadcast"]

logger = logging.getLogger("pypto_serving.router")

LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
LORA_PATHS = (LOAD, UNLOAD)


@dataclass(slots=True)
class _Answer:
    """One replica's answer to a LoRA admin request (status 0: it could not be reached)."""

    replica: Replica
    status: int
    body: bytes
    content_type: str = "text/plain"


@dataclass(slots=True)
class LoraBroadcast:
    """The adapters loaded through the router (name -> path) and the broadcasts that keep every
    replica serving exactly those."""

    replicas: dict[str, Replica]
    adapters: dict[str, str] = field(default_factory=dict)
    # Per replica, the adapters it confirmed loading through the router.
    held: dict[str, dict[str, str]] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def handle(self, path: str, body: bytes) -> Response:
        """The answer to a client's load or unload (``body`` as the replica API takes it)."""
        name = _adapter_name(body)
        if name is None:
            return error_response(400, "the body must be a JSON object with a string lora_name", "invalid_lora")
        async with self.lock:  # one change at a time: a load and an unload of a name never interleave
            targets = [r for r in self.replicas.values() if r.load.healthy]
            if not targets:
                return error_response(503, "no replica is healthy", "no_replica", {"retry-after": "1"})
            if path == LOAD:
                return await self._load(targets, name, body)
            return await self._unload(targets, name, body)

    async def _load(self, targets: list[Replica], name: str, body: bytes) -> Response:
        answers = await asyncio.gather(*(_post(r, LOAD, body) for r in targets))
        failed = next((a for a in answers if a.status != 200), None)
        loaded = [a.replica for a in answers if a.status == 200]
        if failed is None:
            path = json.loads(body).get("lora_path", "")
            self.adapters[name] = path
            for replica in loaded:
                self.held.setdefault(replica.name, {})[name] = path
            return PlainTextResponse(f"Success: LoRA adapter '{name}' added on {len(loaded)} replica(s).")
        undo = json.dumps({"lora_name": name}).encode()
        await asyncio.gather(*(_post(r, UNLOAD, undo) for r in loaded))
        logger.warning("LoRA adapter %s not loaded: replica %s refused it", name, failed.replica.name)
        return _relay(failed, f"replica {failed.replica.name} could not load LoRA adapter {name!r}")

    async def _unload(self, targets: list[Replica], name: str, body: bytes) -> Response:
        answers = await asyncio.gather(*(_post(r, UNLOAD, body) for r in targets))
        self.adapters.pop(name, None)
        for answer in answers:
            if answer.status in (200, 404):
                self.held.get(answer.replica.name, {}).pop(name, None)
        failed = next((a for a in answers if a.status not in (200, 404)), None)
        if failed is not None:
            return _relay(failed, f"replica {failed.replica.name} could not unload LoRA adapter {name!r}")
        if all(a.status == 404 for a in answers):
            return _relay(answers[0], "")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed on {len(answers)} replica(s).")

    async def sync(self, replica: Replica) -> str | None:
        """Bring a replica coming back into the router's adapters; why it cannot be, or None."""
        async with self.lock:
            held = self.held.setdefault(replica.name, {})
            for name in [n for n in held if self.adapters.get(n) != held[n]]:
                answer = await _post(replica, UNLOAD, json.dumps({"lora_name": name}).encode())
                if answer.status not in (200, 404):
                    return f"cannot unload LoRA adapter {name!r}: {_text(answer)}"
                del held[name]
            for name, path in self.adapters.items():
                if name in held:
                    continue
                answer = await _post(replica, LOAD, json.dumps({"lora_name": name, "lora_path": path}).encode())
                if answer.status != 200 and not (answer.status == 409 and b"already loaded" in answer.body):
                    return f"cannot load LoRA adapter {name!r}: {_text(answer)}"
                held[name] = path
            return None


async def _post(replica: Replica, path: str, body: bytes) -> _Answer:
    headers = {"content-type": "application/json"}
    if replica.config.admin_api_key is not None:
        headers["authorization"] = f"Bearer {replica.config.admin_api_key}"
    try:
        r = await replica.client.post(path, content=body, headers=headers)
    except (httpx.HTTPError, OSError) as e:
        return _Answer(replica, 0, f"{type(e).__name__}: {e}".encode())
    return _Answer(replica, r.status_code, r.content, r.headers.get("content-type", "text/plain"))


def _relay(answer: _Answer, context: str) -> Response:
    """The replica's own answer (its status and body); 502 when it could not be reached."""
    if answer.status == 0:
        return error_response(502, f"{context}: {answer.body.decode(errors='replace')}", "replica_failed")
    headers = {"x-pypto-replica": answer.replica.name}
    return Response(answer.body, answer.status, headers=headers, media_type=answer.content_type)


def _text(answer: _Answer) -> str:
    return f"{answer.status or 'unreachable'} {answer.body[:200].decode(errors='replace')}"


def _adapter_name(body: bytes) -> str | None:
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    name = data.get("lora_name") if isinstance(data, dict) else None
    return name if isinstance(name, str) and name else None
