"""The model's tokenizer (transformers), its chat template and EOS ids."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class Tokenizer:
    """Wraps a transformers tokenizer: encode, decode, chat template, EOS ids."""

    def __init__(self, hf: Any, chat_template: str | None = None,
                 extra_eos_ids: tuple[int, ...] = ()) -> None:
        self.hf = hf
        if chat_template is not None:
            self.hf.chat_template = _read_template(chat_template)
        eos = {hf.eos_token_id} if hf.eos_token_id is not None else set()
        self.eos_token_ids: frozenset[int] = frozenset(eos | set(extra_eos_ids))
        self.bos_token_id: int | None = hf.bos_token_id
        self.vocab_size = len(hf)

    @classmethod
    def from_model_path(
        cls, path: str, gguf_file: str | None = None, chat_template: str | None = None
    ) -> Tokenizer:
        """From a HF folder, or from the folder of a GGUF file plus its name."""
        from transformers import AutoTokenizer

        if gguf_file is not None:
            hf = AutoTokenizer.from_pretrained(path, gguf_file=gguf_file)
        else:
            hf = AutoTokenizer.from_pretrained(path)
        return cls(hf, chat_template, _generation_config_eos(path))

    @classmethod
    def from_hf(cls, hf: Any, chat_template: str | None = None) -> Tokenizer:
        return cls(hf, chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_str(self, token_id: int) -> str:
        """Text of one token on its own, as logprobs report it."""
        return self.hf.decode([token_id], skip_special_tokens=False)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return list(self.hf.convert_ids_to_tokens(ids))

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        if not getattr(self.hf, "chat_template", None):
            raise ValueError(
                "this model's tokenizer has no chat template; pass --chat-template "
                "or use the completions API"
            )
        return self.hf.apply_chat_template(
            [_flatten_content(m) for m in messages],
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        # The template already writes BOS where the model wants one.
        text = self.apply_chat_template(messages, add_generation_prompt)
        return self.encode(text, add_special_tokens=False)


def _flatten_content(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ValueError("only text content parts are supported")
            texts.append(str(part.get("text", "")))
        message = dict(message, content="".join(texts))
    elif content is None:
        message = dict(message, content="")
    return message


def _read_template(template: str) -> str:
    if os.path.isfile(template):
        return Path(template).read_text()
    return template


def _generation_config_eos(path: str) -> tuple[int, ...]:
    gen = Path(path) / "generation_config.json"
    if not gen.is_file():
        return ()
    eos = json.loads(gen.read_text()).get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
