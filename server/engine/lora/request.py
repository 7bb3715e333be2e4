"""Which adapter a request runs with: vLLM's ``LoRARequest`` (a leaf type, no torch; the API,
the offline ``LLM`` and the scheduler all hold it)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A PEFT adapter by name, integer id (> 0, unique per adapter) and folder, in vLLM's
    order: ``LoRARequest("sql", 1, "/adapters/sql")``. Equal ids are the same adapter: the
    id keys the device slot, the host cache and the prefix-cache hash."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    # vLLM's --lora-modules JSON form: the model the adapter's card names as its parent
    base_model_name: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be > 0 (got {self.lora_int_id})")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id
