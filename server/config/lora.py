"""Multi-LoRA serving (``--enable-lora``): vLLM's flags and its runtime-update knob."""

from __future__ import annotations

import json
from dataclasses import dataclass

from server.config.fields import flag, knob, option

GROUP = "LoRA adapters"
LORA_DTYPES = ("auto", "float16", "bfloat16", "float32")


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """One ``--lora-modules`` entry: the name requests select it by, and its folder."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModule:
    """``name=path``, or vLLM's JSON form ``{"name": ..., "path": ...,
    "base_model_name": ...}``."""
    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
            return LoRAModule(str(data["name"]), str(data["path"]),
                              data.get("base_model_name"))
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"--lora-modules {text}: JSON needs \"name\" and \"path\"") from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text}: expected name=path or JSON")
    return LoRAModule(name, path)


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """Adapters served beside the base model: ``max_loras`` on the device at once (fixed
    slots, ranks padded to ``max_lora_rank``), ``max_cpu_loras`` kept in host memory."""

    enable_lora: bool = flag(False, group=GROUP,
                             help="serve LoRA adapters (selected by a request's model)")
    lora_modules: tuple[str, ...] = flag(
        (), group=GROUP, metavar="NAME=PATH",
        help="adapters served from start-up: name=path, or JSON {\"name\", \"path\", "
             "\"base_model_name\"}")
    max_loras: int = flag(1, group=GROUP,
                          help="adapters in one batch (device slots); more wait their turn")
    max_lora_rank: int = flag(16, group=GROUP, help="largest adapter rank served")
    max_cpu_loras: int | None = flag(
        None, group=GROUP, help="adapters kept in host memory (least recently used dropped, "
                                "read again when needed; unset: --max-loras)")
    lora_dtype: str = flag("auto", group=GROUP, choices=LORA_DTYPES,
                           help="adapter weights' dtype (auto: the model's)")
    allow_runtime_lora_updating: bool = knob(
        False, env="VLLM_ALLOW_RUNTIME_LORA_UPDATING",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter")

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"{option(type(self), 'max_loras')} must be >= 1")
        if self.max_lora_rank < 1:
            raise ValueError(f"{option(type(self), 'max_lora_rank')} must be >= 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"{option(type(self), 'max_cpu_loras')} ({self.max_cpu_loras}) "
                             f"must be >= --max-loras ({self.max_loras})")
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"--lora-dtype must be one of {', '.join(LORA_DTYPES)}")
        modules = self.modules  # checks the syntax at start-up
        if modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        names = [m.name for m in modules]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules: a name is given twice ({names})")

    @property
    def modules(self) -> list[LoRAModule]:
        return [parse_lora_module(text) for text in self.lora_modules]

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras
