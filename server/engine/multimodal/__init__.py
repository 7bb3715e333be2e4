"""Image input in the engine: the processor that turns a prompt's images into placeholder
tokens and pixels (``processor.py``), the vision encoder's own phase with its buckets and
its cache keyed by image hash (``encoder.py``), and the leaf types the scheduler and the
block manager read (``inputs.py``: where each image sits in the prompt, its hash)."""
