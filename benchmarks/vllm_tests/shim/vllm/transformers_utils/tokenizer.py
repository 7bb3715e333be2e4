from vllm.tokenizers import get_tokenizer

__all__ = ["get_tokenizer"]
