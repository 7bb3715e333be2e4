"""Which checkpoints pool, and loading them: the runner's auto choice (as vLLM makes it), the
model built on the meta device and filled from safetensors by name.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from server.models.encoders.bert import BertConfig, BertEncoder
from server.models.encoders.decoder import FAMILIES, DecoderConfig, DecoderEncoder
from server.models.encoders.st_folder import (
    PoolingType,
    SentenceTransformerSpec,
    read_sentence_transformer,
)
from server.models.errors import model_file_error
from server.models.safetensors_files import safetensors_tensors

logger = logging.getLogger(__name__)

_ENCODERS = {"bert": False, "xlm-roberta": True, "roberta": True}
# base models without an LM head: what vLLM serves as embedders when they are named
_EMBEDDER_ARCHS = ("BertModel", "XLMRobertaModel", "RobertaModel", "LlamaModel",
                   "MistralModel", "Qwen2Model", "Qwen3Model")


def _config_json(folder: str) -> dict[str, object]:
    path = Path(folder, "config.json")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise model_file_error(path, str(exc).splitlines()[0]) from None


def checkpoint_pools(folder: str) -> bool:
    """Whether ``--runner auto`` serves this folder as a pooling model: a sentence-transformers
    folder, a ``*ForSequenceClassification`` head, or a headless encoder / base model."""
    if Path(folder, "modules.json").is_file():
        return True
    if not Path(folder, "config.json").is_file():
        return False
    archs = [str(a) for a in _config_json(folder).get("architectures") or ()]  # type: ignore[union-attr]
    return any(a.endswith("ForSequenceClassification") or a in _EMBEDDER_ARCHS for a in archs)


@dataclass(slots=True)
class LoadedPoolingModel:
    """A pooling model, its settings, and how it reads its input."""

    model: BertEncoder | DecoderEncoder
    classify: bool  # the checkpoint has (or was converted to) a class head
    num_labels: int
    pooling: PoolingType  # how token states become the embedding
    normalize: bool  # embeddings are L2-normalized by default
    st: SentenceTransformerSpec
    max_tokens: int  # the position table's length
    bidirectional: bool  # an encoder (BERT family), not a causal LM
    dtype: torch.dtype
    matryoshka_dimensions: tuple[int, ...] | None  # None: not a Matryoshka model
    num_bytes: int
    seconds: float


def load_pooling_model(folder: str, dtype: torch.dtype, device: torch.device,
                       classify: bool | None) -> LoadedPoolingModel:
    """Loads ``folder`` as a pooling model. ``classify``: True/False forces a class head
    (``--convert classify``) or none (``--convert embed``), None: as the checkpoint is."""
    from transformers import AutoConfig

    start = time.monotonic()
    try:
        hf = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        raise model_file_error(Path(folder, "config.json"), str(exc).splitlines()[0]) from None
    archs = list(getattr(hf, "architectures", None) or ())
    has_head = any(a.endswith("ForSequenceClassification") for a in archs)
    classify = has_head if classify is None else classify
    if classify and not has_head:
        # vLLM scores a causal LM by its "yes" / "no" next-token logits (Qwen3-Reranker, with
        # --hf-overrides classifier_from_token): not implemented, so said rather than guessed
        raise ValueError("--convert classify needs a *ForSequenceClassification checkpoint "
                         f"(this one is {', '.join(archs) or hf.model_type}); scoring a "
                         "causal LM by its yes/no token logits (Qwen3-Reranker) is not "
                         "supported")
    st = read_sentence_transformer(folder)
    model: BertEncoder | DecoderEncoder
    if hf.model_type in _ENCODERS:
        roberta = _ENCODERS[hf.model_type]
        cfg = BertConfig.from_hf(hf, roberta)
        with torch.device("meta"):
            model = BertEncoder(cfg, roberta, classify)
        pooling, bidirectional = PoolingType.CLS, True
    elif hf.model_type in FAMILIES:
        dcfg = DecoderConfig.from_hf(hf)
        with torch.device("meta"):
            model = DecoderEncoder(dcfg, classify)
        pooling, bidirectional = PoolingType.LAST, False
    else:
        raise ValueError(f"model_type {hf.model_type!r} cannot be served as a pooling model "
                         f"(supported: {', '.join([*_ENCODERS, *FAMILIES])})")
    model.to_empty(device=device)
    if isinstance(model, DecoderEncoder):
        model.build_rotary(device)
    _fill(model, Path(folder), classify)
    model.to(dtype)
    if isinstance(model, DecoderEncoder):
        model.inv_freq = model.inv_freq.float()
    model.eval()
    dims = getattr(hf, "matryoshka_dimensions", None)
    matryoshka = (tuple(int(d) for d in dims) if dims
                  else (() if getattr(hf, "is_matryoshka", False) else None))
    num_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    seconds = time.monotonic() - start
    logger.info("Loaded %s as a pooling model (%s%s): %.1f MiB of weights, dtype %s, %.1f s",
                folder, type(model).__name__, ", class head" if classify else "",
                num_bytes / 2**20, str(dtype).replace("torch.", ""), seconds)
    return LoadedPoolingModel(
        model, classify, getattr(hf, "num_labels", 2), st.pooling or pooling,
        st.normalize if st.found else True, st, model.cfg.max_tokens, bidirectional, dtype,
        matryoshka, num_bytes, seconds)


def _fill(model: nn.Module, folder: Path, classify: bool) -> None:
    """Copies every checkpoint tensor into the module of the same name; every parameter must
    be filled, and a tensor with no module is an error unless it belongs to a head this
    model does not run (an MLM head, BERT's pooler when not classifying)."""
    params = dict(model.named_parameters())
    filled: set[str] = set()
    for key, tensor in safetensors_tensors(folder):
        name = model.checkpoint_name(key)  # type: ignore[operator]
        if name is None:
            continue
        target = params.get(name)
        if target is None:
            if not classify and name.startswith(("pooler.", "classifier.", "score.")):
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
