"""Buckets: the pre-planned shapes every step runs in.

``plan`` turns the bucketing flags and ``VLLM_*_BUCKET_*`` knobs into the warmup plan,
``lookup`` pads each step's batch to its bucket (counting misses), ``observed`` records the
unpadded shapes traffic really had, ``fit`` fits a plan to them, ``adaptive`` adds buckets
while serving, and ``suggest`` prints a plan for an operator to pin.
"""
