"""Warmup's stand-in inputs: exactly a bucket's shape, and nothing a real step could not hold."""

from __future__ import annotations

import torch

from server.engine.worker.input_builder import InputBuilder
from server.hpu.types import Bucket, Phase


def test_prefill_dummy_positions_stay_inside_the_context_window() -> None:
    """A prefill bucket is rounded up on both axes, so its context + query width can pass
    max_model_len (here 31 blocks of 16 + 512 > 512). Its stand-in positions must still index
    the RoPE tables, which end at max_model_len: on CUDA an index past them is a device-side
    assert that kills the process at warmup (seen on an H200)."""
    builder = InputBuilder(16, 256, torch.device("cpu"), torch.float32, 512)
    for bucket in (Bucket(1, 512, 31), Bucket(2, 64, 31), Bucket(1, 16, 0)):
        inputs = builder.dummy(Phase.PREFILL, bucket)
        assert tuple(inputs.input_ids.shape) == (bucket.batch, bucket.query)
        assert int(inputs.positions.max()) < 512
        if bucket.blocks:  # the tables keep the bucket's width: the shape is the bucket's
            assert inputs.meta.context_tables.shape[1] == bucket.blocks + -(-bucket.query // 16)
