"""Multi-LoRA, model side: PEFT checkpoints read and checked (peft.py), the batched op
(ops.py) and the fixed device slots the model's projections read (slots.py)."""

from server.models.lora.peft import AdapterError, LoRAAdapter, LoRASite, load_peft_adapter
from server.models.lora.slots import LayerLoRA, LoRASlots, SlotWriter

__all__ = ["AdapterError", "LayerLoRA", "LoRAAdapter", "LoRASite", "LoRASlots",
           "SlotWriter", "load_peft_adapter"]
