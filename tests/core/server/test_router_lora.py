"""The router passes run-time LoRA loads and unloads on to every replica: all of them serve an adapter
or none does, an unload reaches each, and a replica that was down gets the adapters loaded meanwhile
before it takes requests again.

The replicas are small apps answering the replica's LoRA admin routes as ``serve`` does (200 with a
text body, 400/404/409 with an OpenAI error body), recording what they were sent, so the test sees
exactly which replica got which call with which key."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from tests.core.server.conftest import LiveServer
from tests.core.server.router_helpers import RouterThread

TOKEN = "router-admin"


@dataclass
class FakeReplica:
    """A replica's LoRA admin routes and /health; ``refuse`` makes its loads answer 400."""

    key: str
    loaded: dict[str, str] = field(default_factory=dict)
    calls: list[tuple[str, str, str | None]] = field(default_factory=list)
    healthy: bool = True
    refuse: str | None = None

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/health", self._health),
                Route("/v1/load_lora_adapter", self._load, methods=["POST"]),
                Route("/v1/unload_lora_adapter", self._unload, methods=["POST"]),
            ]
        )

    async def _health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"} if self.healthy else {"status": "down"}, 200 if self.healthy else 503)

    async def _load(self, request: Request) -> Response:
        body = await request.json()
        self.calls.append(("load", body["lora_name"], request.headers.get("authorization")))
        if request.headers.get("authorization") != f"Bearer {self.key}":
            return _error(401, "missing or invalid admin key")
        if self.refuse is not None:
            return _error(400, self.refuse)
        if body["lora_name"] in self.loaded:
            return _error(409, f"LoRA adapter {body['lora_name']!r} is already loaded; unload it first")
        self.loaded[body["lora_name"]] = body["lora_path"]
        return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' added successfully.")

    async def _unload(self, request: Request) -> Response:
        body = await request.json()
        self.calls.append(("unload", body["lora_name"], request.headers.get("authorization")))
        if self.loaded.pop(body["lora_name"], None) is None:
            return _error(404, f"LoRA adapter {body['lora_name']!r} is not loaded")
        return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "code": "x"}}, status)


@pytest.fixture
def fleet() -> Iterator[tuple[list[FakeReplica], RouterThread]]:
    from pypto_serving.router import RouterSettings

    fakes = [FakeReplica(key=f"key-{i}") for i in range(3)]
    servers = [LiveServer(f.app()) for f in fakes]
    settings = RouterSettings(
        replicas=[{"url": s.url, "name": f"r{i}", "admin_api_key": f"key-{i}"} for i, s in enumerate(servers)],
        admin_token=TOKEN,
        health_interval=0.1,
        unhealthy_after=1,
    )
    router = RouterThread(settings)
    yield fakes, router
    router.stop()
    for s in servers:
        s.stop()


def _post(router: RouterThread, path: str, body: dict[str, Any], token: str | None = TOKEN) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.post(router.url + path, json=body, headers=headers, timeout=10)


def _replica_state(router: RouterThread, name: str) -> dict[str, Any]:
    listing = httpx.get(router.url + "/router/replicas", headers={"authorization": f"Bearer {TOKEN}"}).json()
    return next(r for r in listing["replicas"] if r["name"] == name)


def _wait(predicate: Any, what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_load_and_an_unload_reach_every_replica_with_its_admin_key(fleet: Any) -> None:
    fakes, router = fleet
    assert _post(router, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/p"}, token=None).status_code == 401
    assert _post(router, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/p"}, token="no").status_code == 401
    assert not any(f.calls for f in fakes)
    r = _post(router, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/p"})
    assert r.status_code == 200, r.text
    assert [f.loaded for f in fakes] == [{"a": "/p"}] * 3
    assert [f.calls for f in fakes] == [[("load", "a", f"Bearer key-{i}")] for i in range(3)]
    # A second load of the name: the replicas' 409 comes back, and they keep the adapter.
    again = _post(router, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/q"})
    assert again.status_code == 409 and "already loaded" in again.json()["error"]["message"]
    assert [f.loaded for f in fakes] == [{"a": "/p"}] * 3
    r = _post(router, "/v1/unload_lora_adapter", {"lora_name": "a"})
    assert r.status_code == 200, r.text
    assert [f.loaded for f in fakes] == [{}] * 3
    gone = _post(router, "/v1/unload_lora_adapter", {"lora_name": "a"})
    assert gone.status_code == 404 and "not loaded" in gone.json()["error"]["message"]
    bad = _post(router, "/v1/load_lora_adapter", {"lora_path": "/p"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_lora"


def test_a_refused_load_is_unloaded_from_the_replicas_that_took_it(fleet: Any) -> None:
    fakes, router = fleet
    fakes[1].refuse = "no adapter_config.json in /p"
    r = _post(router, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/p"})
    assert r.status_code == 400 and "adapter_config.json" in r.json()["error"]["message"]
    assert r.headers["x-pypto-replica"] == "r1"
    assert [f.loaded for f in fakes] == [{}] * 3  # every replica or none
    assert [c[0] for c in fakes[0].calls] == ["load", "unload"]
    assert [c[0] for c in fakes[1].calls] == ["load"]


def test_a_replica_back_from_down_gets_the_adapters_before_it_takes_requests(fleet: Any) -> None:
    fakes, router = fleet
    fakes[2].healthy = False
    _wait(lambda: not _replica_state(router, "r2")["healthy"], "r2 marked down")
    assert _post(router, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/pa"}).status_code == 200
    assert _post(router, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": "/pb"}).status_code == 200
    assert _post(router, "/v1/unload_lora_adapter", {"lora_name": "a"}).status_code == 200
    assert fakes[2].loaded == {} and fakes[2].calls == []
    # It comes back refusing loads: it stays out of routing, saying why.
    fakes[2].refuse = "max_loras reached"
    fakes[2].healthy = True
    _wait(lambda: "max_loras reached" in str(_replica_state(router, "r2")["last_error"]), "r2 held back")
    assert not _replica_state(router, "r2")["healthy"]
    assert httpx.get(router.url + "/health").json()["replicas"] == ["r0", "r1"]
    fakes[2].refuse = None
    _wait(lambda: _replica_state(router, "r2")["healthy"], "r2 back")
    assert [f.loaded for f in fakes] == [{"b": "/pb"}] * 3  # "a", unloaded meanwhile, never reached it
