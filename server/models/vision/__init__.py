"""Vision towers of vision-language models: what turns an image's pixels into rows of the
language model's embeddings. The language model itself is the Llama-family decoder
(server/models/llama.py); ``config.py`` reads a checkpoint's vision settings, ``llava.py``
builds LLaVA's CLIP tower and projector."""

from server.models.vision.config import VisionConfig, vision_config_of
from server.models.vision.llava import LlavaVision, build_vision

__all__ = ["LlavaVision", "VisionConfig", "build_vision", "vision_config_of"]
