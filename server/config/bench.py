"""``hpu-serve bench``'s options: a synthetic streaming workload against any OpenAI server
(the shape and flag names of ``vllm bench serve``)."""

from __future__ import annotations

from dataclasses import dataclass

from server.config.fields import flag, knob


@dataclass(frozen=True, slots=True)
class BenchOptions:
    """One benchmark run: the server, the workload, the arrivals, the report."""

    base_url: str = flag("http://127.0.0.1:8000", help="any OpenAI-compatible server")
    model: str | None = flag(None, help="model name sent in requests (default: first of "
                                        "/v1/models)")
    tokenizer: str | None = flag(None, help="HF folder or .gguf whose tokenizer sizes the "
                                            "prompts (default: the embedded SmolLM2 model)")
    endpoint: str = flag("completions", choices=("completions", "chat"),
                         help="the API the requests go to")
    num_prompts: int = flag(100, help="requests sent (conversations with --turns)")
    input_len: int = flag(200, help="prompt tokens")
    output_len: int = flag(128, help="tokens to generate")
    shared_prefix_len: int = flag(
        0, help="tokens of a prefix common to every prompt (a shared system prompt), before "
                "each prompt's own --input-len tokens")
    long_prompt_fraction: float = flag(
        0.0, help="this fraction of the prompts is --long-input-len tokens long")
    long_input_len: int = flag(4096, help="prompt tokens of the long prompts")
    turns: int = flag(1, help="each prompt opens a chat of this many user turns (--input-len "
                              "new tokens each), every turn resending the history with the "
                              "server's answers (needs --endpoint chat)")
    range_ratio: float = flag(0.0, help="lengths uniform in [len*(1-r), len*(1+r)]; 0 = fixed")
    request_rate: float = flag(float("inf"), help="requests per second (Poisson arrivals); "
                                                  "inf = all at once")
    burstiness: float = flag(1.0, help="gamma shape of arrival gaps; 1 = Poisson")
    max_concurrency: int | None = flag(None, help="at most this many requests in flight")
    seed: int = flag(0, help="seed of the prompts' tokens, lengths and arrival gaps")
    ignore_eos: bool = flag(True, name="no-ignore-eos",
                            help="let generation stop at EOS (default: always --output-len "
                                 "tokens)")
    api_key: str | None = flag(None, help="bearer key sent to the server")
    warmup_requests: int = flag(1, help="untimed requests sent first")
    result_file: str | None = flag(None, help="write the results as JSON here")
    label: str = flag("", help="stored in the result file")
    progress: bool = flag(True, name="no-progress", help="no progress bar")
    cache_dir: str | None = knob(
        None, env="HPU_SERVE_CACHE_DIR",
        help="where a GGUF's tokenizer, converted once, is kept (the server's cache: a bench "
             "after a served GGUF, or a second bench, loads it in ~2 s, not ~9 s)")
