"""Multi-LoRA, model side: PEFT checkpoints read and checked (peft.py), the batched op
(ops.py) and the fixed device slots the model's projections read (slots.py)."""

from server.models.lora.peft import AdapterError, LoRAAdapter, LoRASite, load_peft_adapter
from server.models.lora.slots import LayerLoRA, LoRASlots

__all__ = ["AdapterError", "LayerLoRA", "LoRAAdapter", "LoRASite", "LoRASlots",
           "load_peft_adapter"]
