"""DeepSeek-V3's multi-token-prediction (MTP) layer as a speculative draft head
(vLLM's ``method: mtp`` / ``deepseek_mtp``).

The checkpoint stores it as the decoder layer after the last one (``model.layers.{L}.*``,
``L = num_hidden_layers``; ``num_nextn_predict_layers`` of them): a full DeepSeek decoder
layer (latent attention, MoE or dense MLP) whose input is ``eh_proj`` (2H -> H) over
``[enorm(embed(token at p)); hnorm(hidden at p - 1)]``, and whose output (its MLP output
plus the residual stream) goes through ``shared_head.norm`` and ``shared_head.head`` to
predict the token at ``p + 1``. The hidden input is the target's final, normed hidden state
at ``p - 1``, or past the first draft step the layer's own output there: the layer is
applied again for every further draft token (as vLLM does with one layer).

It runs on the EAGLE heads' seam (server/engine/worker/eagle.py: the feature store of
hidden states per KV slot, mirrored target steps, warmed buckets), so this module only
has to look like an :class:`~server.models.eagle.EagleHead`. Built as a one-layer
:class:`LlamaForCausalLM` whose ``norm`` / ``lm_head`` / ``embed_tokens`` are the MTP
layer's ``shared_head.norm`` / ``shared_head.head`` / ``embed_tokens``: the target's
loader (weight_load.py) fills it, with the DeepSeek handling it already has (RoPE rows
de-interleaved, experts stacked, FP8 dequantized, every weight checked present).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from server.hpu.attention import AttentionMetadata
from server.hpu.kv_cache import KVCache
from server.models.config import ModelConfig
from server.models.errors import ModelFileError
from server.models.llama import LlamaForCausalLM
from server.models.norm import RMSNorm
from server.models.quantized import dequantized
from server.models.safetensors_files import safetensors_files, safetensors_slices
from server.models.weight_load import TensorOrigin, load_into

logger = logging.getLogger(__name__)

WHERE = "--speculative-config mtp"
# the MTP layer's own tensors outside its decoder block, as this module names them
_OUTSIDE_BLOCK = {"enorm.": "enorm.", "hnorm.": "hnorm.", "eh_proj.": "eh_proj.",
                  "shared_head.norm.": "norm.", "shared_head.head.": "lm_head.",
                  "embed_tokens.": "embed_tokens."}


class DeepSeekMTP(LlamaForCausalLM):
    """One MTP layer beside its target, with an EAGLE head's interface (``features``,
    ``forward`` over hidden inputs, ``compute_logits``, ``share_with``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        hidden = cfg.hidden_size
        self.enorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        # whether the checkpoint's embedding / head differ from the target's (else shared)
        self.own_embeddings = True
        self.own_lm_head = True

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def features(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The target's final, normed hidden state is what the layer reads."""
        return target_hidden[:, :self.hidden_size]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,  # type: ignore[override]
                hidden: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
                ) -> torch.Tensor:
        """input_ids/positions ``[bs, q]``, ``hidden`` ``[bs * q, H]`` (the hidden state
        at each token's previous position) -> the layer's output ``[bs * q, H]`` before
        ``shared_head.norm``: the next draft step's hidden input."""
        embeds = self.embed_tokens(input_ids)
        rope = self.rotary(positions, embeds.dtype)
        prev = hidden.view(embeds.shape).to(embeds.dtype)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(prev)], dim=-1))
        x, residual = self.layers[0](x, torch.zeros_like(x), rope, kv_caches[0], meta)
        out = x + residual
        return out.reshape(-1, out.shape[-1])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden)).float()

    def share_with(self, target: LlamaForCausalLM) -> None:
        """Reads the target's embeddings / LM head as they are now (the platform may have
        replaced them since the layer was loaded), where the checkpoint's are the same."""
        if not self.own_embeddings:
            self.embed_tokens = target.embed_tokens
        if not self.own_lm_head:
            self.lm_head = target.lm_head

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids  # the target's vocabulary


def mtp_tensor_name(name: str, layer: int) -> str | None:
    """A checkpoint name of MTP layer ``layer`` -> this module's (None: another tensor)."""
    prefix = f"model.layers.{layer}."
    if not name.startswith(prefix):
        return None
    rest = name.removeprefix(prefix)
    for theirs, ours in _OUTSIDE_BLOCK.items():
        if rest.startswith(theirs):
            return ours + rest.removeprefix(theirs)
    return "layers.0." + rest


def load_mtp_head(folder: str, is_gguf: bool, target: LlamaForCausalLM, dtype: torch.dtype,
                  device: torch.device) -> DeepSeekMTP:
    """The target's first MTP layer, read from its own checkpoint at ``folder``; a
    ValueError says why a target has none that this server can serve."""
    tcfg = target.config
    if tcfg.mla is None or not tcfg.model_type.startswith("deepseek"):
        raise ValueError(f"{WHERE}: the target ({tcfg.model_type}) has no DeepSeek MTP "
                         "layers (method mtp serves DeepSeek-V3 checkpoints)")
    if tcfg.mtp_layers == 0:
        raise ValueError(f"{WHERE}: the target has no MTP layers (its config's "
                         "num_nextn_predict_layers is 0)")
    if is_gguf:
        raise ValueError(f"{WHERE}: not from a GGUF file yet (a safetensors checkpoint "
                         "holds the MTP layer)")
    layer = tcfg.num_layers
    if tcfg.mtp_layers > 1:
        logger.info("MTP: the checkpoint has %d MTP layers; drafting with the first (layer "
                    "%d), applied once per draft token", tcfg.mtp_layers, layer)
    if not safetensors_files(Path(folder)):
        raise ValueError(f"{WHERE}: no safetensors in {folder}")
    names = {ours for name, _ in safetensors_slices(Path(folder))
             if (ours := mtp_tensor_name(name, layer)) is not None}
    if not any(n.startswith("layers.0.") for n in names):
        raise ValueError(f"{WHERE}: the checkpoint in {folder} holds no tensors of MTP layer "
                         f"{layer} (model.layers.{layer}.*; its config says "
                         f"num_nextn_predict_layers {tcfg.mtp_layers})")
    # the MTP layer is sparse where the checkpoint gives it a router (DeepSeek-V3's is)
    sparse = any(n.startswith(("layers.0.mlp.gate.", "layers.0.mlp.experts."))
                 for n in names)
    cfg = dataclasses.replace(tcfg, num_layers=1, mtp_layers=0,
                              moe_layers=(0,) if sparse else ())
    # absent from the checkpoint: the target's (vLLM's rule for shared_head.head too)
    own_embeddings = "embed_tokens.weight" in names
    own_lm_head = "lm_head.weight" in names
    borrowed = ([] if own_embeddings else [("embed_tokens.weight", target.embed_tokens.weight)]
                ) + ([] if own_lm_head else [("lm_head.weight", target.lm_head.weight)])
    with torch.device("meta"):
        head = DeepSeekMTP(cfg)
    head.to_empty(device=device)
    head.to(dtype)
    if cfg.moe_router.score_bias:
        head.keep_router_bias_in_float()
    head.rotary, head.rotary_local = head.build_rotary(device)
    try:
        load_into(head, itertools.chain(_read(Path(folder), layer, tcfg), borrowed),
                  TensorOrigin(folder, False))
    except ModelFileError as exc:
        raise ValueError(f"{WHERE}: MTP layer {layer}: {exc}") from None
    head.eval()
    # the same tensors as the target's: share them (the memory, and any packing the
    # platform gives the target's)
    head.own_embeddings = own_embeddings and not torch.equal(
        head.embed_tokens.weight, target.embed_tokens.weight)
    head.own_lm_head = own_lm_head and not torch.equal(head.lm_head.weight,
                                                       target.lm_head.weight)
    head.share_with(target)
    return head


def _read(folder: Path, layer: int, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """MTP layer ``layer``'s tensors, one at a time (only those are read from disk),
    dequantized like the target's, under this module's names."""
    def picked() -> Iterator[tuple[str, torch.Tensor]]:
        pattern = re.compile(rf"model\.layers\.{layer}\.")
        for name, part in safetensors_slices(folder):
            if pattern.match(name):
                yield name, part[:]  # type: ignore[index]

    tensors = picked()
    if cfg.quant is not None:
        tensors = dequantized(tensors, cfg.quant)
    for name, tensor in tensors:
        ours = mtp_tensor_name(name, layer)
        if ours is not None and not ours.endswith("rotary_emb.inv_freq"):
            yield ours, tensor
