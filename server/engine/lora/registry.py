"""The adapters a server answers to, by name (a leaf, no torch: the API reads it to resolve a
request's ``model`` and to list ``/v1/models``)."""

from __future__ import annotations

import itertools
import threading

from server.engine.errors import RequestError
from server.engine.lora.request import LoRARequest


class LoRANotFoundError(RequestError):
    """No adapter of that name is loaded (HTTP 404, vLLM's NotFoundError)."""


class LoRARegistry:
    """Name -> :class:`LoRARequest`; ids handed out once each (a reloaded name gets a new
    id, so no prefix-cache entry of the old weights can serve it). Thread-safe."""

    def __init__(self) -> None:
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def new_request(self, name: str, path: str, base_model_name: str | None = None
                    ) -> LoRARequest:
        """A request for a new adapter (not registered until :meth:`add`)."""
        if not name or not path:
            raise RequestError("Both 'lora_name' and 'lora_path' must be provided.",
                               "lora_name" if not name else "lora_path")
        with self._lock:
            if name in self._by_name:
                raise RequestError(f"The lora adapter '{name}' has already been loaded.",
                                   "lora_name")
            return LoRARequest(name, next(self._ids), path, base_model_name)

    def add(self, request: LoRARequest) -> None:
        with self._lock:
            if request.lora_name in self._by_name:
                raise RequestError(
                    f"The lora adapter '{request.lora_name}' has already been loaded.",
                    "lora_name")
            self._by_name[request.lora_name] = request

    def remove(self, name: str) -> LoRARequest:
        with self._lock:
            request = self._by_name.pop(name, None)
        if request is None:
            raise LoRANotFoundError(f"The lora adapter '{name}' cannot be found.", "lora_name")
        return request

    def get(self, name: str) -> LoRARequest | None:
        with self._lock:
            return self._by_name.get(name)

    def all(self) -> list[LoRARequest]:
        with self._lock:
            return list(self._by_name.values())

    def known_id(self, adapter_id: int) -> bool:
        with self._lock:
            return any(r.lora_int_id == adapter_id for r in self._by_name.values())
