"""The few ``vllm`` names vLLM's HTTP tests import, stood in for without vLLM: the version is
hpu-serve's (the server under test answers /version with it), the tokenizer is the embedded
model's, and names from vLLM's internals (used only by its unit tests, listed as not
applicable in known.py) exist so that the modules collect."""
