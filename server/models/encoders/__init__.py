"""Pooling models: bidirectional encoders (BERT, XLM-RoBERTa), causal LMs read as embedders or
classifiers, and the sentence-transformers folder settings around them.

No KV cache: a pooling model runs whole padded batches (``[batch, length]``) once.
"""
