"""The model creator's recommended sampling settings (``--generation-config``), as vLLM reads
them: the sampling fields of a Hugging Face ``generation_config.json``, or a GGUF file's
``general.sampling.*`` keys (llama.cpp's; a GGUF has no generation_config.json).

Only the fields that change what a request samples are taken (``GENERATION_FIELDS``);
``do_sample`` is not one of them, as in vLLM: a temperature stays a temperature.
"""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Mapping
from typing import Any

from server.config.model import GENERATION_FIELDS
from server.models.errors import MissingModelFileError, model_file_error

GENERATION_FILE = "generation_config.json"

# llama.cpp's keys with the same meaning as generation_config.json's fields. Its
# penalty_repeat is left out: llama.cpp applies it to the last penalty_last_n tokens only,
# a window the repetition_penalty of the Hugging Face rule (and of this engine) has not.
GGUF_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
}


class GenerationConfigMode(enum.Enum):
    """What ``--generation-config`` names."""

    AUTO = "auto"  # the served model's own
    VLLM = "vllm"  # none: the API's neutral defaults
    PATH = "path"  # a folder's generation_config.json


def mode_of(setting: str) -> GenerationConfigMode:
    if setting in ("auto", "vllm"):
        return GenerationConfigMode(setting)
    return GenerationConfigMode.PATH


def generation_defaults(setting: str, folder: str, gguf_reader: object | None,
                        overrides: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """The request defaults ``--generation-config setting`` gives (vLLM's names:
    ``max_new_tokens`` becomes ``max_tokens``), with ``overrides``
    (``--override-generation-config``) on top, and where they came from (for the log).
    ``folder``: the served model's; ``gguf_reader``: its GGUF file's header, when it is one."""
    mode = mode_of(setting)
    found: dict[str, Any] = {}
    where = "vLLM's defaults (--generation-config vllm)"
    if mode is GenerationConfigMode.AUTO:
        if gguf_reader is not None:
            found = gguf_sampling(gguf_reader)
            where = "the GGUF file's general.sampling.* keys"
        else:
            found = read_generation_config(folder) or {}
            where = os.path.join(folder, GENERATION_FILE)
    elif mode is GenerationConfigMode.PATH:
        found = read_generation_config(setting, required=True) or {}
        where = os.path.join(setting, GENERATION_FILE)
    fields = {k: v for k, v in {**found, **overrides}.items()
              if k in GENERATION_FIELDS and v is not None}
    if overrides:
        where += " and --override-generation-config"
    if "max_new_tokens" in fields:
        fields["max_tokens"] = fields.pop("max_new_tokens")
    return fields, where


def read_generation_config(folder: str, required: bool = False) -> dict[str, Any] | None:
    """The JSON object of ``folder``'s generation_config.json; None where there is none
    (an error when ``required``: the user named that folder)."""
    path = os.path.join(folder, GENERATION_FILE)
    if not os.path.isfile(path):
        if required:
            raise MissingModelFileError(f"--generation-config {folder}: no {GENERATION_FILE} "
                                        "there")
        return None
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as exc:
        raise model_file_error(path, str(exc).splitlines()[0]) from None
    if not isinstance(value, dict):
        raise model_file_error(path, "not a JSON object")
    return value


def gguf_sampling(reader: Any) -> dict[str, Any]:
    """The sampling settings a GGUF's author wrote into its header (llama.cpp's keys)."""
    found: dict[str, Any] = {}
    for key, name in GGUF_SAMPLING_KEYS.items():
        field = reader.fields.get(key)
        if field is not None and field.data:
            value = field.parts[field.data[0]][0].item()
            found[name] = int(value) if name == "top_k" else float(value)
    return found
