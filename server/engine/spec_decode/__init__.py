"""Speculative decoding: draft proposers (pure Python) and acceptance statistics."""
