"""A vision-language checkpoint's vision settings, read once from its Hugging Face config."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

from server.models.registry import served_as_text
from server.models.vision.llama4_config import Llama4VisionConfig, llama4_vision_config
from server.models.vision.qwen2_5_vl_config import QwenVisionConfig, qwen_vision_config


class VisionFamily(str, enum.Enum):
    """The vision-language families served (config.json's ``model_type``)."""

    LLAVA = "llava"
    GEMMA3 = "gemma3"
    QWEN2_5_VL = "qwen2_5_vl"
    LLAMA4 = "llama4"

    def __str__(self) -> str:
        return self.value


# the architectures of config.json that carry a vision tower, by family
VISION_ARCHITECTURES = {"LlavaForConditionalGeneration": VisionFamily.LLAVA,
                        "Gemma3ForConditionalGeneration": VisionFamily.GEMMA3,
                        "Qwen2_5_VLForConditionalGeneration": VisionFamily.QWEN2_5_VL,
                        "Llama4ForConditionalGeneration": VisionFamily.LLAMA4}


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """What the vision tower needs to build itself, and what the engine needs to place its
    output: the image token the prompt carries, and how many rows each image becomes."""

    family: VisionFamily
    image_token_id: int
    text_hidden_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str  # the tower's MLP activation (quick_gelu, gelu)
    projector_act: str
    projector_bias: bool
    # which hidden state feeds the projector (-2: the second to last layer's output)
    feature_layer: int
    # "default": the class token is dropped; "full": kept
    feature_select: str
    # Gemma 3: the patch rows are average-pooled into this many rows per image (0: none)
    mm_tokens_per_image: int = 0
    # Gemma 3: an image's tokens attend to each other both ways in the prefill (its
    # prompt chunk holds the whole image, see server/hpu/attention.py image_ends)
    bidirectional: bool = False

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens_per_image(self) -> int:
        """Rows of the language model's embeddings one image becomes (fixed for LLaVA and
        Gemma 3: their processors resize every image to ``image_size``)."""
        if self.mm_tokens_per_image:
            return self.mm_tokens_per_image
        return self.num_patches + (1 if self.feature_select == "full" else 0)

    def describe(self) -> str:
        return (f"{self.family}, {self.layers_run} layers of width {self.hidden_size}, "
                f"{self.tokens_per_image} image tokens of {self.image_size}x{self.image_size} "
                "pixels")

    @property
    def layers_run(self) -> int:
        """Tower layers up to the selected hidden state (the rest would be discarded)."""
        layer = self.feature_layer
        return layer if layer >= 0 else self.num_layers + 1 + layer


# a vision-language checkpoint's vision settings, whichever family it is
AnyVisionConfig = VisionConfig | QwenVisionConfig | Llama4VisionConfig


def vision_config_of(hf: Any) -> AnyVisionConfig | None:
    """The vision settings of a Hugging Face config; None for a text-only model. A vision
    checkpoint of a family not served is a ValueError naming it."""
    vision = getattr(hf, "vision_config", None)
    if vision is None:
        return None
    architectures = getattr(hf, "architectures", None) or []
    family = next((VISION_ARCHITECTURES[a] for a in architectures
                   if a in VISION_ARCHITECTURES), None)
    if family is VisionFamily.LLAMA4:
        return llama4_vision_config(hf, family)
    if served_as_text(architectures):
        return None  # served as its text model: the tower is skipped at load
    if family is None and getattr(hf, "model_type", None) == "llava":
        family = VisionFamily.LLAVA
    if family is None:
        given = ", ".join(architectures) or getattr(hf, "model_type", "?")
        raise ValueError(f"vision-language architecture {given} is not supported; supported: "
                         f"{', '.join(sorted(VISION_ARCHITECTURES))}")
    if family is VisionFamily.GEMMA3:
        return _gemma3(hf, vision)
    if family is VisionFamily.QWEN2_5_VL:
        return qwen_vision_config(hf, family)
    if getattr(vision, "model_type", "clip_vision_model") != "clip_vision_model":
        raise ValueError(f"LLaVA with a {vision.model_type} vision tower is not supported "
                         "(clip_vision_model)")
    layer = getattr(hf, "vision_feature_layer", -2)
    if not isinstance(layer, int):
        raise ValueError(f"vision_feature_layer {layer!r}: only one layer is supported")
    select = getattr(hf, "vision_feature_select_strategy", "default")
    if select not in ("default", "full"):
        raise ValueError(f"vision_feature_select_strategy {select!r} is not supported")
    token = getattr(hf, "image_token_id", None)
    if token is None:
        token = getattr(hf, "image_token_index")
    return VisionConfig(
        family=family,
        image_token_id=int(token),
        text_hidden_size=int(hf.text_config.hidden_size),
        hidden_size=int(vision.hidden_size),
        intermediate_size=int(vision.intermediate_size),
        num_layers=int(vision.num_hidden_layers),
        num_heads=int(vision.num_attention_heads),
        image_size=int(vision.image_size),
        patch_size=int(vision.patch_size),
        num_channels=int(getattr(vision, "num_channels", 3)),
        layer_norm_eps=float(getattr(vision, "layer_norm_eps", 1e-5)),
        hidden_act=str(getattr(vision, "hidden_act", "quick_gelu")),
        projector_act=str(getattr(hf, "projector_hidden_act", "gelu")),
        projector_bias=bool(getattr(hf, "multimodal_projector_bias", True)),
        feature_layer=layer,
        feature_select=select,
    )


def _gemma3(hf: Any, vision: Any) -> VisionConfig:
    """Gemma 3: the whole SigLIP tower (post-norm included), pooled to
    ``mm_tokens_per_image`` rows a side's square."""
    if getattr(vision, "model_type", "siglip_vision_model") != "siglip_vision_model":
        raise ValueError(f"Gemma 3 with a {vision.model_type} vision tower is not supported "
                         "(siglip_vision_model)")
    tokens = int(hf.mm_tokens_per_image)
    side = int(vision.image_size) // int(vision.patch_size)
    pooled = math.isqrt(tokens)
    if pooled * pooled != tokens or side % pooled:
        raise ValueError(f"mm_tokens_per_image {tokens}: not a square that pools the "
                         f"{side}x{side} patches evenly")
    return VisionConfig(
        family=VisionFamily.GEMMA3,
        image_token_id=int(hf.image_token_id),
        text_hidden_size=int(hf.text_config.hidden_size),
        hidden_size=int(vision.hidden_size),
        intermediate_size=int(vision.intermediate_size),
        num_layers=int(vision.num_hidden_layers),
        num_heads=int(vision.num_attention_heads),
        image_size=int(vision.image_size),
        patch_size=int(vision.patch_size),
        num_channels=int(getattr(vision, "num_channels", 3)),
        layer_norm_eps=float(getattr(vision, "layer_norm_eps", 1e-6)),
        hidden_act=str(getattr(vision, "hidden_act", "gelu_pytorch_tanh")),
        projector_act="none",
        projector_bias=False,
        feature_layer=-1,
        feature_select="full",
        mm_tokens_per_image=tokens,
        bidirectional=True,
    )
