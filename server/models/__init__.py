"""Model definitions and weight loading (Llama family, Hugging Face folders and GGUF files).

Owns: architecture configs, the decoder, RoPE variants, checkpoint readers.
May import: ``server.hpu`` (attention metadata, KV cache and layer-op types). Never the
engine or HTTP.
"""
