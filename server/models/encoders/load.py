"""Which checkpoints pool, and loading them: the runner's auto choice (as vLLM makes it), the
model built on the meta device and filled from safetensors by name.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from server.models.encoders.bert import BertConfig, BertEncoder
from server.models.encoders.decoder import FAMILIES, DecoderConfig, DecoderEncoder
from server.models.encoders.modernbert import ModernBertConfig, ModernBertEncoder
from server.models.encoders.st_folder import (
    PoolingType,
    SentenceTransformerSpec,
    read_sentence_transformer,
)
from server.models.encoders.token_head import TokenHead
from server.models.errors import model_file_error
from server.models.safetensors_files import safetensors_tensors

logger = logging.getLogger(__name__)

_ENCODERS = {"bert": False, "xlm-roberta": True, "roberta": True}
# base models without an LM head: what vLLM serves as embedders when they are named
_EMBEDDER_ARCHS = ("BertModel", "XLMRobertaModel", "RobertaModel", "ModernBertModel",
                   "LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model")
_MODERNBERT = "modernbert"


def _config_json(folder: str) -> dict[str, object]:
    path = Path(folder, "config.json")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise model_file_error(path, str(exc).splitlines()[0]) from None


def checkpoint_pools(folder: str, overrides: Mapping[str, Any] | None = None) -> bool:
    """Whether ``--runner auto`` serves this folder as a pooling model: a sentence-transformers
    folder, a ``*ForSequenceClassification`` head, or a headless encoder / base model (the
    architectures ``--hf-overrides`` names count, as in vLLM)."""
    if Path(folder, "modules.json").is_file():
        return True
    if not Path(folder, "config.json").is_file():
        return False
    named = (overrides or {}).get("architectures")
    if named is None:
        named = _config_json(folder).get("architectures")
    archs = [str(a) for a in named or ()]  # type: ignore[union-attr]
    return any(a.endswith("ForSequenceClassification") or a in _EMBEDDER_ARCHS for a in archs)


@dataclass(slots=True)
class LoadedPoolingModel:
    """A pooling model, its settings, and how it reads its input."""

    model: BertEncoder | ModernBertEncoder | DecoderEncoder
    classify: bool  # the checkpoint has (or was converted to) a class head
    num_labels: int
    pooling: PoolingType  # how token states become the embedding
    head_pooling: PoolingType  # which states the class head reads (CLS, LAST or MEAN)
    normalize: bool  # embeddings are L2-normalized by default
    st: SentenceTransformerSpec
    max_tokens: int  # the position table's length
    bidirectional: bool  # an encoder (BERT family), not a causal LM
    # a (text_1, text_2) pair is read as the one text text_1 + text_2 (an LLM reranker's
    # prompt), not as the tokenizer's pair with separators (vLLM's use_sep_token false)
    pairs_as_text: bool
    dtype: torch.dtype
    matryoshka_dimensions: tuple[int, ...] | None  # None: not a Matryoshka model
    num_bytes: int
    seconds: float


def load_pooling_model(folder: str, dtype: torch.dtype, device: torch.device,
                       classify: bool | None, overrides: Mapping[str, Any] | None = None,
                       token_id: Callable[[str], int | None] | None = None
                       ) -> LoadedPoolingModel:
    """Loads ``folder`` as a pooling model. ``classify``: True/False forces a class head
    (``--convert classify``) or none (``--convert embed``), None: as the checkpoint is.
    ``overrides``: config.json fields set over the checkpoint's (``--hf-overrides``);
    ``token_id``: the tokenizer's id of a token, for a head read from the LM head's rows."""
    from transformers import AutoConfig

    start = time.monotonic()
    try:
        hf = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        raise model_file_error(Path(folder, "config.json"), str(exc).splitlines()[0]) from None
    for key, value in (overrides or {}).items():
        setattr(hf, key, value)
    token_head = TokenHead.from_hf(hf)
    if token_head is not None:
        if hf.model_type not in FAMILIES:
            raise ValueError(f"classifier_from_token needs a causal LM ({', '.join(FAMILIES)}),"
                             f" not {hf.model_type!r}")
        hf.num_labels = token_head.num_labels
    archs = list(getattr(hf, "architectures", None) or ())
    has_head = token_head is not None or any(
        a.endswith("ForSequenceClassification") for a in archs)
    classify = has_head if classify is None else classify
    if classify and not has_head:
        raise ValueError("--convert classify needs a *ForSequenceClassification checkpoint "
                         f"(this one is {', '.join(archs) or hf.model_type}), or a causal LM "
                         "scored by its token logits (--hf-overrides with "
                         "classifier_from_token, as for Qwen3-Reranker)")
    token_head = token_head if classify else None
    st = read_sentence_transformer(folder)
    model: BertEncoder | ModernBertEncoder | DecoderEncoder
    if hf.model_type in _ENCODERS:
        roberta = _ENCODERS[hf.model_type]
        cfg = BertConfig.from_hf(hf, roberta)
        with torch.device("meta"):
            model = BertEncoder(cfg, roberta, classify)
        pooling = head_pooling = PoolingType.CLS
        bidirectional = True
    elif hf.model_type == _MODERNBERT:
        mcfg = ModernBertConfig.from_hf(hf)
        with torch.device("meta"):
            model = ModernBertEncoder(mcfg, classify)
        pooling, head_pooling, bidirectional = PoolingType.CLS, mcfg.classifier_pooling, True
    elif hf.model_type in FAMILIES:
        dcfg = DecoderConfig.from_hf(hf)
        with torch.device("meta"):
            model = DecoderEncoder(dcfg, classify)
        pooling = head_pooling = PoolingType.LAST
        bidirectional = False
    else:
        raise ValueError(f"model_type {hf.model_type!r} cannot be served as a pooling model "
                         f"(supported: {', '.join([*_ENCODERS, _MODERNBERT, *FAMILIES])})")
    model.to_empty(device=device)
    if isinstance(model, DecoderEncoder):
        model.build_rotary(device)
    lm_head = _fill(model, Path(folder), classify, token_head is not None)
    if token_head is not None:
        assert isinstance(model, DecoderEncoder) and token_id is not None
        if lm_head is None:  # tied: the LM head is the embedding table
            lm_head = model.embed_tokens.weight.detach()
        with torch.no_grad():
            model.score.weight.copy_(token_head.score_weight(lm_head, token_id))
    model.to(dtype)
    if isinstance(model, DecoderEncoder):
        model.inv_freq = model.inv_freq.float()
        if classify:  # the head in float32, as vLLM runs it (a difference of two logits)
            model.score.float()
    model.eval()
    dims = getattr(hf, "matryoshka_dimensions", None)
    matryoshka = (tuple(int(d) for d in dims) if dims
                  else (() if getattr(hf, "is_matryoshka", False) else None))
    num_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    seconds = time.monotonic() - start
    head = (f", head from the logits of {', '.join(token_head.tokens)} ({token_head.method})"
            if token_head else ", class head" if classify else "")
    logger.info("Loaded %s as a pooling model (%s%s): %.1f MiB of weights, dtype %s, %.1f s",
                folder, type(model).__name__, head,
                num_bytes / 2**20, str(dtype).replace("torch.", ""), seconds)
    return LoadedPoolingModel(
        model, classify, getattr(hf, "num_labels", 2), st.pooling or pooling, head_pooling,
        st.normalize if st.found else True, st, model.cfg.max_tokens, bidirectional,
        not _use_sep_token(hf, token_head), dtype, matryoshka, num_bytes, seconds)


def _use_sep_token(hf: Any, token_head: TokenHead | None) -> bool:
    """Whether a pair is tokenized as a pair (vLLM's ``use_sep_token``, formerly
    ``use_pad_token``): yes for cross-encoders, no for an LLM read by its token logits, whose
    prompt the two texts spell out together."""
    for key in ("use_sep_token", "use_pad_token"):
        value = getattr(hf, key, None)
        if value is not None:
            return bool(value)
    return token_head is None


def _fill(model: nn.Module, folder: Path, classify: bool,
          token_head: bool) -> torch.Tensor | None:
    """Copies every checkpoint tensor into the module of the same name; every parameter must
    be filled, and a tensor with no module is an error unless it belongs to a head this
    model does not run (an MLM head, a pooler or class head when not classifying). With
    ``token_head`` the score head is made from the LM head afterwards: its tensor is
    returned (None: tied to the embeddings)."""
    params = dict(model.named_parameters())
    filled: set[str] = {"score.weight"} if token_head else set()
    lm_head: torch.Tensor | None = None
    for key, tensor in safetensors_tensors(folder):
        if token_head and key == "lm_head.weight":
            lm_head = tensor
            continue
        name = model.checkpoint_name(key)  # type: ignore[operator]
        if name is None:
            continue
        target = params.get(name)
        if target is None:
            if not classify and name.startswith(("pooler.", "classifier.", "score.",
                                                 "head_block.")):
                continue
            raise model_file_error(folder, f"tensor {key} belongs to no layer of the model")
        if tuple(target.shape) != tuple(tensor.shape):
            raise model_file_error(folder, f"tensor {key} has shape {tuple(tensor.shape)}, "
                                           f"the model expects {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(tensor.to(target.dtype))
        filled.add(name)
    missing = sorted(set(params) - filled)
    if missing:
        raise model_file_error(folder, f"missing tensors: {', '.join(missing[:5])}"
                                       f"{'...' if len(missing) > 5 else ''}")
    return lm_head
