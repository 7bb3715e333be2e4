"""The worker: one step on the device, for one rank.

The model runner owns the model, its KV cache tensors and its graphs; the input builder turns
a scheduled batch into the padded tensors of its bucket; the sampler picks the tokens. Imports
the scheduling core's types, never the front end or the executors.
"""
