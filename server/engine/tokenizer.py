"""The model's tokenizer (transformers), its chat template and EOS ids."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from server.models.gguf_check import metadata_digest

logger = logging.getLogger(__name__)

# File suffixes that mark a --chat-template value as a path rather than Jinja text.
_TEMPLATE_SUFFIXES = (".jinja", ".jinja2", ".j2", ".tmpl", ".txt")
# Pipeline parts that keep every byte of the text (so one token never stands for more text
# than its own decoding): with any other part, no byte count bounds the token count.
_KEEPING_NORMALIZERS = frozenset({"Prepend", "NFD"})
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Punctuation",
                                     "UnicodeScripts"})


# init_kwargs that say where and how the files were loaded, not how text is tokenized
_LOADING_KWARGS = frozenset({"vocab_file", "merges_file", "tokenizer_file", "name_or_path",
                             "is_local", "local_files_only", "cache_dir", "gguf_file"})


def _json_value(value: Any) -> Any:
    """``value`` with added tokens as their text and anything else JSON lacks as a string."""
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    content = getattr(value, "content", None)  # tokenizers' AddedToken
    return content if isinstance(content, str) else str(value)


class Tokenizer:
    """Wraps a transformers tokenizer: encode, decode, chat template, EOS ids.

    ``eos_token_ids`` is the tokenizer's EOS plus any extra ids (``generation_config.json``'s
    ``eos_token_id`` when the model folder has one, or ``extra_eos_ids`` passed in).
    """

    def __init__(
        self, hf: Any, chat_template: str | None = None, extra_eos_ids: Iterable[int] = ()
    ) -> None:
        self.hf = hf
        if chat_template is not None:
            self.hf.chat_template = _read_template(chat_template)
        eos = {int(hf.eos_token_id)} if hf.eos_token_id is not None else set()
        self.eos_token_ids: frozenset[int] = frozenset(eos | {int(i) for i in extra_eos_ids})
        self.bos_token_id: int | None = hf.bos_token_id
        self.vocab_size: int = len(hf)
        self._token_str_cache: dict[int, str] = {}

    @classmethod
    def from_model_path(
        cls,
        path: str,
        gguf_file: str | None = None,
        chat_template: str | None = None,
        extra_eos_ids: Iterable[int] = (),
        cache_dir: str | Path | None = None,
    ) -> Tokenizer:
        """From a HF folder (tokenizer.json, ...), or from the folder of a GGUF file plus its
        name. Never downloads: ``path`` must be a local folder.

        Building a tokenizer from a GGUF's vocabulary takes seconds (~5 s for SmolLM2's
        49k tokens); with ``cache_dir`` the converted files are saved there once, keyed by
        the GGUF's path, size and mtime, and later starts load those instead.
        """
        from transformers import AutoTokenizer

        if not os.path.isdir(path):
            raise ValueError(f"tokenizer folder {path!r} does not exist")
        if gguf_file is not None:
            hf = _gguf_tokenizer(path, gguf_file, cache_dir)
        else:
            hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        extra = (*_generation_config_eos(path), *extra_eos_ids)
        return cls(hf, chat_template, extra)

    @classmethod
    def from_hf(
        cls, hf_tokenizer: Any, chat_template: str | None = None, extra_eos_ids: Iterable[int] = ()
    ) -> Tokenizer:
        """Wraps an already-built transformers tokenizer."""
        return cls(hf_tokenizer, chat_template, extra_eos_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with BOS etc. when ``add_special_tokens``)."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; incomplete UTF-8 at either end comes out as U+FFFD."""
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_str(self, token_id: int) -> str:
        """Text of one token on its own, as logprobs report it (cached per id).

        A byte-level token holding part of a multi-byte character decodes to U+FFFD.
        """
        text = self._token_str_cache.get(token_id)
        if text is None:
            text = self.hf.decode([token_id], skip_special_tokens=False)
            self._token_str_cache[token_id] = text
        return text

    @functools.cached_property
    def max_token_bytes(self) -> int | None:
        """The most UTF-8 bytes of input one token can stand for, so that a text of ``b``
        bytes has at least ``b / max_token_bytes`` tokens: a cheap bound to refuse an
        oversized prompt before tokenizing it. None when the tokenizer may drop or shrink
        text (whitespace splitting, NFKC, fused unknowns...): then no byte count bounds it.
        Decodes the whole vocabulary once (~0.35 s for 49k tokens), on first use."""
        if not _keeps_every_byte(self.hf):
            return None
        texts = self.hf.batch_decode([[i] for i in range(len(self.hf))],
                                     skip_special_tokens=False)
        # +1: a decoder may drop the leading space of a lone token ("\u2581word" -> "word");
        # at least 4: an unknown character (up to 4 bytes) may become one token
        return max(4, max((len(t.encode("utf-8")) for t in texts), default=0) + 1)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        """Raw vocabulary strings (e.g. ``Ġworld``, ``▁world``) of ``ids``."""
        return list(self.hf.convert_ids_to_tokens(list(ids)))

    def settings(self) -> dict[str, Any]:
        """The tokenizer's own settings (transformers' ``init_kwargs``: special tokens,
        ``add_bos_token``, ``model_max_length``...) as JSON values, its class name and its
        chat template: what ``GET /tokenizer_info`` reports, in vLLM's shape. Where the files
        were read from is left out (a path on this machine says nothing about tokenizing)."""
        init_kwargs = getattr(self.hf, "init_kwargs", None) or {}
        config = {k: _json_value(v) for k, v in init_kwargs.items() if k not in _LOADING_KWARGS}
        config["tokenizer_class"] = type(self.hf).__name__
        template = getattr(self.hf, "chat_template", None)
        if isinstance(template, str) and template:  # --chat-template's, when given
            config["chat_template"] = template
        return config

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
        documents: list[dict[str, str]] | None = None,
        content_parts: bool = False,
    ) -> str:
        """Prompt text for ``messages``; content may be a str or a list of text parts.
        ``content_parts``: contents are lists of parts as they are (a vision model's
        template, which writes its image placeholder for each ``{"type": "image"}``).
        ``tools`` (OpenAI's function definitions) and ``template_kwargs`` (variables such as
        ``enable_thinking``) are handed to the template. ``continue_final_message``: the
        last message is left open (no end of turn after it) for the model to go on with.
        ``documents``: what a retrieval-augmented template lists (title, text...).

        Raises ``ValueError`` when the tokenizer has no chat template, a part isn't text,
        or the template fails on these messages.
        """
        if not self.has_chat_template:
            raise ValueError(
                "this model's tokenizer has no chat template; pass --chat-template "
                "or use the completions API"
            )
        from jinja2 import TemplateError

        try:
            text = self.hf.apply_chat_template(
                messages if content_parts else [_flatten_content(m) for m in messages],
                tools=tools or None,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                documents=documents or None,
                **(template_kwargs or {}),
            )
        except TemplateError as exc:  # raise_exception() in templates, undefined variables
            raise ValueError(f"the chat template failed on these messages: {exc}") from None
        if not isinstance(text, str):  # some versions hand back a one-element list
            text = text[0] if isinstance(text, list) and text else str(text)
        return text

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of the chat prompt; the template already writes BOS where wanted."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, template_kwargs)
        return self.encode(text, add_special_tokens=False)


def _keeps_every_byte(hf: Any) -> bool:
    """Whether a fast tokenizer's pipeline keeps all of its input (byte-level BPE, Llama's
    SentencePiece BPE): its parts are read from its JSON description."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        return False
    try:
        spec = json.loads(backend.to_str())
    except (ValueError, AttributeError):
        return False
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or (model.get("fuse_unk") and not model.get("byte_fallback")):
        return False
    if any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or ()):
        return False  # such a token swallows the whitespace around it, however long
    return _parts_keep(spec.get("normalizer"), "normalizers", _KEEPING_NORMALIZERS) and \
        _parts_keep(spec.get("pre_tokenizer"), "pretokenizers", _KEEPING_PRE_TOKENIZERS)


def _parts_keep(part: dict[str, Any] | None, members: str, keeping: frozenset[str]) -> bool:
    if part is None:
        return True
    kind = part.get("type")
    if kind == "Sequence":
        return all(_parts_keep(p, members, keeping) for p in part.get(members) or ())
    if kind == "Replace":  # Llama's " " -> "\u2581": never shorter than what it replaces
        pattern = (part.get("pattern") or {}).get("String")
        return pattern is not None and \
            len(str(part.get("content", "")).encode()) >= len(pattern.encode())
    if kind == "Split":  # a regex split keeps the text unless told to remove the matches
        return part.get("behavior") != "Removed"
    return kind in keeping


def _flatten_content(message: dict[str, Any]) -> dict[str, Any]:
    """OpenAI content-part arrays become one string (text parts joined)."""
    if not isinstance(message, dict):
        raise ValueError("each chat message must be an object with 'role' and 'content'")
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
                continue
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"only text content parts are supported, got {kind!r}")
            texts.append(str(part.get("text", "")))
        message = dict(message, content="".join(texts))
    elif content is None:
        message = dict(message, content="")
    return message


def _read_template(template: str) -> str:
    """A Jinja string as-is, or the contents of the file it names."""
    if os.path.isfile(template):
        return Path(template).read_text(encoding="utf-8")
    if "{" not in template and template.endswith(_TEMPLATE_SUFFIXES):
        raise ValueError(f"chat template file {template!r} does not exist")
    return template


def _generation_config_eos(path: str) -> tuple[int, ...]:
    """``eos_token_id`` (int or list) of ``generation_config.json`` in ``path``, if any."""
    gen = Path(path) / "generation_config.json"
    if not gen.is_file():
        return ()
    try:
        eos = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError):
        return ()
    if eos is None:
        return ()
    items = eos if isinstance(eos, list) else [eos]
    return tuple(int(i) for i in items if isinstance(i, int))


def _from_gguf(folder: str, gguf_file: str) -> Any:
    """transformers' tokenizer of a GGUF file's vocabulary. AutoTokenizer picks its class from
    the file's config, which transformers reads only for the architectures it runs; for the
    others (deepseek2, llama4...), and where its reader of the config fails (transformers
    5.x on a gpt-oss file with YaRN keys: a TypeError), the same vocabulary converts into
    the generic fast tokenizer (a broken vocabulary still fails there)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        return AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file, local_files_only=True)
    except (ValueError, TypeError) as exc:
        logger.info("transformers reads no config from %s (%s): its vocabulary becomes a "
                    "generic fast tokenizer", gguf_file, exc)
    return PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=gguf_file,
                                                   local_files_only=True)


def _gguf_tokenizer(folder: str, gguf_file: str, cache_dir: str | Path | None) -> Any:
    """transformers' tokenizer of a GGUF file, through the converted-files cache if given."""
    import transformers
    from transformers import AutoTokenizer

    if cache_dir is None:
        return _from_gguf(folder, gguf_file)
    # keyed by what the conversion reads, the file's metadata: a copy or a move of the file
    # finds its entry, a file rewritten with another vocabulary does not
    metadata = metadata_digest(str(Path(folder, gguf_file)))
    key = hashlib.sha256(f"{metadata}|{transformers.__version__}".encode()).hexdigest()[:16]
    cached = Path(cache_dir) / f"gguf-{key}"
    if (cached / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(cached, local_files_only=True)
    hf = _from_gguf(folder, gguf_file)
    try:  # a cache that cannot be written only costs the next start the conversion again
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{cached.name}-", dir=cache_dir))
        hf.save_pretrained(staging)
        os.replace(staging, cached)  # atomic: a concurrent start sees all of it or nothing
    except OSError as exc:
        logger.warning("could not cache the converted tokenizer in %s: %s", cache_dir, exc)
    return hf
