"""Data parallelism and run-time LoRA adapters: a load reaches every replica or none (a replica that
refuses it has the others unload it again), an unload reaches every replica, and the served list is
the replicas' own."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pypto_serving.config import ServingSettings
from pypto_serving.lora import LoraError
from pypto_serving.server.data_parallel import DataParallelLLM


class _Replica:
    """What DataParallelLLM asks of a replica for adapters: its loads and unloads, and its stats."""

    def __init__(self, settings: ServingSettings, refuse: str | None = None) -> None:
        self.settings, self.refuse, self.on_finished = settings, refuse, None
        self.loaded: list[str] = []
        self.dead_reason = None

    @property
    def stats(self) -> dict[str, Any]:
        return {"lora_adapters": list(self.loaded)}

    async def load_lora(self, name: str, path: str) -> None:
        if self.refuse is not None:
            raise LoraError(400, self.refuse)
        if name in self.loaded:
            raise LoraError(409, f"LoRA adapter {name!r} is already loaded")
        self.loaded.append(name)

    async def unload_lora(self, name: str) -> None:
        if name not in self.loaded:
            raise LoraError(404, f"LoRA adapter {name!r} is not loaded")
        self.loaded.remove(name)


def test_a_load_reaches_every_replica_or_none() -> None:
    settings = ServingSettings()
    first, second, refusing = _Replica(settings), _Replica(settings), _Replica(settings, "rank 8 exceeds")
    with pytest.raises(LoraError, match="rank 8 exceeds"):
        asyncio.run(DataParallelLLM(settings, replicas=[first, second, refusing]).load_lora("a", "/a"))  # type: ignore[list-item]
    assert first.loaded == second.loaded == []  # taken back from the replicas that had loaded it
    router = DataParallelLLM(settings, replicas=[first, second])  # type: ignore[list-item]
    asyncio.run(router.load_lora("a", "/a"))
    assert first.loaded == second.loaded == ["a"] and router.stats["lora_adapters"] == ["a"]
    asyncio.run(router.unload_lora("a"))
    assert first.loaded == second.loaded == []
    with pytest.raises(LoraError) as missing:
        asyncio.run(router.unload_lora("a"))
    assert missing.value.status == 404
