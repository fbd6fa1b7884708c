"""``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` (vLLM's names and bodies, behind
the admin key: see guard.py): serve a PEFT adapter directory under a model name at run time, or stop
serving one. With data parallelism every replica loads it (or none does).

A load takes a free slot of ``max_loras``; the steps of running requests stand still while the
worker reads the adapter (the log says for how long). An unload refuses new requests naming the
adapter at once (404) while the requests that selected it before run to their end; then its slot is
free. A name loaded again is a new adapter: nothing cached under the old one is served to it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from ..engine import EngineDeadError
from ..lora import LoraError
from .protocol import APIError

if TYPE_CHECKING:
    from .openai_requests import _Ctx

__all__ = ["add_lora_routes"]


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_path: str


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_int_id: int | None = None  # vLLM's optional id; names identify adapters here


def _api_error(e: LoraError | EngineDeadError) -> APIError:
    if isinstance(e, EngineDeadError):
        return APIError(503, f"the engine is unavailable: {e}", type="server_error", code="engine_dead")
    if e.status >= 500:  # the worker failed to load it for a reason of its own (see the server log)
        return APIError(e.status, str(e), type="server_error", code="lora_load_failed")
    code = {404: "lora_not_found", 409: "lora_conflict"}.get(e.status, "invalid_lora")
    return APIError(e.status, str(e), param="lora_name" if e.status != 400 else None, code=code)


def add_lora_routes(app: FastAPI, ctx: _Ctx) -> None:
    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoraRequest) -> str:
        if body.lora_name == ctx.model_name:
            raise APIError(409, f"{body.lora_name!r} is the base model's name", param="lora_name", code="lora_conflict")
        try:
            await ctx.llm.load_lora(body.lora_name, body.lora_path)
        except (LoraError, EngineDeadError) as e:
            raise _api_error(e) from None
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoraRequest) -> str:
        try:
            await ctx.llm.unload_lora(body.lora_name)
        except (LoraError, EngineDeadError) as e:
            raise _api_error(e) from None
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
