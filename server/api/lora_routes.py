"""vLLM's runtime adapter endpoints: ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter``, only where ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is true
(otherwise the routes do not exist: 404, as vLLM). Answers and errors in vLLM's words."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from server.api.errors import APIError
from server.engine.errors import RequestError
from server.engine.lora.registry import LoRANotFoundError
from server.engine.lora.request import LoRARequest


@runtime_checkable
class LoRAClient(Protocol):
    """What the routes need from the engine (``AsyncEngine`` provides it)."""

    @property
    def runtime_lora_updating(self) -> bool: ...

    async def load_lora_adapter(self, name: str, path: str) -> LoRARequest: ...

    async def unload_lora_adapter(self, name: str) -> None: ...


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def add_lora_routes(app: FastAPI, engine: object) -> None:
    if not isinstance(engine, LoRAClient) or not engine.runtime_lora_updating:
        return
    client: LoRAClient = engine

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> str:
        """Reads, checks and serves a PEFT adapter under ``lora_name`` (the ``model`` of
        later requests)."""
        try:
            await client.load_lora_adapter(body.lora_name, body.lora_path)
        except RequestError as exc:
            raise APIError(400, exc.message, exc.param, "InvalidUserInput") from None
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> str:
        try:
            await client.unload_lora_adapter(body.lora_name)
        except LoRANotFoundError as exc:
            raise APIError(404, exc.message, exc.param, "NotFoundError") from None
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
