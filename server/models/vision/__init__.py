"""Vision towers of vision-language models: what turns an image's pixels into rows of the
language model's embeddings. The language model itself is the Llama-family decoder
(server/models/llama.py); ``config.py`` reads a checkpoint's vision settings, ``llava.py``
builds LLaVA's CLIP tower and projector, ``gemma3.py`` Gemma 3's SigLIP tower and pooling
projector (``vit.py``: the transformer layer both towers share)."""

from server.models.vision.config import VisionConfig, VisionFamily, vision_config_of
from server.models.vision.gemma3 import Gemma3Vision
from server.models.vision.llava import LlavaVision

# what the engine runs: pixels [n, c, h, w] -> rows [n, tokens_per_image, text hidden]
VisionModel = LlavaVision | Gemma3Vision


def build_vision(cfg: VisionConfig) -> VisionModel:
    """The vision side of ``cfg``'s family (weights uninitialised: load_vision fills them)."""
    if cfg.family is VisionFamily.GEMMA3:
        return Gemma3Vision(cfg)
    return LlavaVision(cfg)


__all__ = ["Gemma3Vision", "LlavaVision", "VisionConfig", "VisionModel", "build_vision",
           "vision_config_of"]
