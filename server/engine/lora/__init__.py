"""Multi-LoRA serving, engine side: the request type, the adapters the server knows by name
(registry.py), and the runner's host cache and device slots (manager.py)."""

from server.engine.lora.request import LoRARequest

__all__ = ["LoRARequest"]
