"""What a sentence-transformers folder says on top of the Hugging Face checkpoint.

``modules.json`` lists the pipeline (Transformer -> Pooling -> Normalize...),
``1_Pooling/config.json`` how token states become one vector, ``sentence_bert_config.json``
the ``max_seq_length`` texts are cut to, ``config_sentence_transformers.json`` named prompts.
Read as JSON only (no torch): the runner choice looks at it before anything loads.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from server.models.errors import model_file_error


class PoolingType(str, enum.Enum):
    """How token states become one vector (vLLM's names)."""

    MEAN = "MEAN"
    CLS = "CLS"
    LAST = "LAST"
    ALL = "ALL"  # no pooling: every token's state (the /pooling endpoint)

    def __str__(self) -> str:
        return self.value


# modules.json "type" class names this server applies (their module paths differ between
# sentence-transformers releases); others (Dense, LayerNorm...) are refused
_TRANSFORMER, _POOLING, _NORMALIZE = "Transformer", "Pooling", "Normalize"


@dataclass(frozen=True, slots=True)
class SentenceTransformerSpec:
    """The sentence-transformers settings of a folder (defaults: none found)."""

    pooling: PoolingType | None = None
    normalize: bool = False
    max_seq_length: int | None = None
    do_lower_case: bool = False
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None

    @property
    def found(self) -> bool:
        return self.pooling is not None


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise model_file_error(path, str(exc).splitlines()[0]) from None


_MODES = {"mean": PoolingType.MEAN, "cls": PoolingType.CLS, "lasttoken": PoolingType.LAST}


def _pooling_type(cfg: dict[str, Any], path: Path) -> PoolingType:
    """The mode of a Pooling module: one ``pooling_mode`` name (sentence-transformers 6) or
    one ``pooling_mode_*`` flag set (earlier releases)."""
    if cfg.get("include_prompt") is False:
        raise model_file_error(path, "include_prompt false is not supported")
    if "pooling_mode" in cfg:
        modes = [str(cfg["pooling_mode"])]
    else:
        modes = [k.removeprefix("pooling_mode_").removesuffix("_tokens").removesuffix("_token")
                 for k, v in cfg.items() if k.startswith("pooling_mode_") and v]
    if len(modes) != 1 or modes[0] not in _MODES:
        raise model_file_error(path, f"pooling mode {'+'.join(modes) or 'none'} is not "
                                     "supported (one of mean, cls or lasttoken)")
    return _MODES[modes[0]]


def read_sentence_transformer(folder: str | Path) -> SentenceTransformerSpec:
    """The folder's sentence-transformers settings; an empty spec without ``modules.json``."""
    root = Path(folder)
    modules_path = root / "modules.json"
    if not modules_path.is_file():
        return SentenceTransformerSpec()
    modules = _read(modules_path)
    pooling: PoolingType | None = None
    normalize = False
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == _POOLING:
            pooling = _pooling_type(_read(root / module["path"] / "config.json"),
                                    root / module["path"] / "config.json")
        elif kind == _NORMALIZE:
            normalize = True
        elif kind != _TRANSFORMER:
            raise model_file_error(modules_path, f"module {kind} is not supported (Transformer, "
                                                 "Pooling and Normalize are)")
    bert_cfg = root / "sentence_bert_config.json"
    st_bert = _read(bert_cfg) if bert_cfg.is_file() else {}
    prompts_cfg = root / "config_sentence_transformers.json"
    st_cfg = _read(prompts_cfg) if prompts_cfg.is_file() else {}
    max_seq_length = st_bert.get("max_seq_length")
    tok_cfg = root / "tokenizer_config.json"
    if max_seq_length is None and tok_cfg.is_file():
        # sentence-transformers 6 keeps it as the tokenizer's model_max_length (a huge
        # sentinel when unset)
        limit = _read(tok_cfg).get("model_max_length")
        max_seq_length = int(limit) if isinstance(limit, (int, float)) and limit < 1e9 else None
    return SentenceTransformerSpec(
        pooling=pooling or PoolingType.MEAN, normalize=normalize,
        max_seq_length=max_seq_length,
        do_lower_case=bool(st_bert.get("do_lower_case", False)),
        prompts=dict(st_cfg.get("prompts") or {}),
        default_prompt_name=st_cfg.get("default_prompt_name"))
