"""Structured outputs: validity at temperature 1, and what a grammar costs.

    python benchmarks/structured_outputs.py [--model PATH] [--samples 200]
    python benchmarks/structured_outputs.py --http http://127.0.0.1:8000   # a running server

1. Validity: ``--samples`` seeded completions at temperature 1 for each of a nested JSON
   schema (objects, enums, arrays, required fields), a JSON object, a regex (ISO dates) and a
   5-way choice, submitted interleaved with as many unguided requests so that guided and
   unguided rows share every batch. Each output is checked independently (``jsonschema``,
   ``re``): complete and valid / cut by ``max_tokens`` but still a valid prefix / invalid.
2. Mask cost: the median decode step at batch 16 with every row guided (the nested schema)
   against no row guided, interleaved rounds.
3. Compile cost: a new schema (cold) and the same schema again (cached by the compiler).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jsonschema  # noqa: E402

from server import LLM, SamplingParams  # noqa: E402
from server.engine.sampling_params import StructuredOutputsParams as Spec  # noqa: E402

NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20},
            "country": {"enum": ["FR", "DE", "US", "JP"]}},
            "required": ["city", "country"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
CHOICES = ["red", "green", "blue", "yellow", "purple"]


def check(kind: str, text: str) -> bool:
    try:
        if kind == "nested":
            jsonschema.validate(json.loads(text), NESTED)
        elif kind == "json_object":
            return isinstance(json.loads(text), dict)
        elif kind == "regex":
            return re.fullmatch(DATE, text) is not None
        else:
            return text in CHOICES
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def is_json_object_prefix(text: str) -> bool:
    """Whether a cut output can still be completed to a JSON object (a character-level
    matcher, independent of the tokenizer and of the server's token masks)."""
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([]))
    grammar = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    return xgr.GrammarMatcher(grammar, terminate_without_stop_token=True).accept_string(text)


# Free-form JSON gets room: at temperature 1 a small model's strings can run long.
MAX_TOKENS = {"nested": 256, "json_object": 768, "regex": 256, "choice": 256}


def validity(llm: LLM, samples: int, kinds: list[str]) -> None:
    specs = {"nested": Spec(json=NESTED), "json_object": Spec(json_object=True),
             "regex": Spec(regex=DATE), "choice": Spec(choice=CHOICES)}
    specs = {k: v for k, v in specs.items() if k in kinds}
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content":
                                         "Reply with a short JSON record of a user."}])
    for kind, spec in specs.items():
        params, prompts = [], []
        for i in range(samples):  # guided and unguided, interleaved: every batch has both
            params.append(SamplingParams(temperature=1.0, seed=i, max_tokens=MAX_TOKENS[kind],
                                         structured_outputs=spec))
            params.append(SamplingParams(temperature=1.0, seed=i, max_tokens=32))
            prompts += [prompt, prompt]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)[::2]
        elapsed = time.perf_counter() - start
        complete = [o.outputs[0] for o in outputs if o.outputs[0].finish_reason == "stop"]
        valid = sum(check(kind, c.text) for c in complete)
        cut = [o.outputs[0].text for o in outputs if o.outputs[0].finish_reason != "stop"]
        prefixes = sum(is_json_object_prefix(t) for t in cut) if kind == "json_object" else 0
        print(f"{kind:>12}: {valid}/{len(complete)} complete outputs valid "
              f"({100.0 * valid / max(1, len(complete)):.1f}%), {len(cut)} cut by max_tokens "
              f"({MAX_TOKENS[kind]})" + (f", {prefixes} of them valid prefixes" if cut and
                                        kind == "json_object" else "") +
              f", {elapsed:.1f} s with the unguided half", flush=True)


def http_validity(url: str, samples: int, kinds: list[str]) -> None:
    """The same check through a running server's chat API: every other guided request
    streamed, all of them in flight at once with as many unguided ones (so they share
    batches), constraints in OpenAI's and vLLM's forms."""
    import concurrent.futures

    import httpx

    fields = {"nested": {"response_format": {"type": "json_schema", "json_schema": {
                  "name": "user", "schema": NESTED, "strict": True}}},
              "json_object": {"response_format": {"type": "json_object"}},
              "regex": {"guided_regex": DATE},
              "choice": {"structured_outputs": {"choice": CHOICES}}}
    messages = [{"role": "user", "content": "Reply with a short JSON record of a user."}]

    def run(job: tuple[str, int]) -> tuple[str, bool, str, str]:
        kind, i = job
        stream = i % 2 == 1
        body = {"messages": messages, "temperature": 1.0, "seed": i, "stream": stream,
                **({"max_tokens": 32} if kind == "free" else
                   {"max_tokens": MAX_TOKENS[kind], **fields[kind]})}
        resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=3600)
        resp.raise_for_status()
        if not stream:
            choice = resp.json()["choices"][0]
            return kind, stream, choice["message"]["content"], choice["finish_reason"]
        text, reason = "", ""
        for line in resp.text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    text += choice["delta"].get("content") or ""
                    reason = choice["finish_reason"] or reason
        return kind, stream, text, reason

    for kind in kinds:
        jobs = [(k, i) for i in range(samples) for k in (kind, "free")]
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            results = [r for r in pool.map(run, jobs) if r[0] != "free"]
        elapsed = time.perf_counter() - start
        for stream in (False, True):
            mine = [(text, reason) for _, s, text, reason in results if s == stream]
            complete = [text for text, reason in mine if reason == "stop"]
            valid = sum(check(kind, t) for t in complete)
            print(f"{kind:>12} {'streamed' if stream else 'whole':>8}: {valid}/{len(complete)} "
                  f"complete outputs valid ({100.0 * valid / max(1, len(complete)):.1f}%), "
                  f"{len(mine) - len(complete)} cut by max_tokens ({MAX_TOKENS[kind]})",
                  flush=True)
        print(f"{kind:>12}: {elapsed:.1f} s for {samples} guided + {samples} unguided")


def decode_step_ms(llm: LLM, guided: bool, bs: int = 16, steps: int = 16) -> float:
    engine = llm.engine
    spec = Spec(json=NESTED) if guided else None
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=steps + 4, ignore_eos=True,
                            structured_outputs=spec)
    for i in range(bs):
        engine.add_request(f"{guided}-{i}-{time.monotonic()}", [7] * 64, params)
    while engine.scheduler.waiting or any(s.num_output_tokens == 0
                                          for s in engine.scheduler.running):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times) * 1e3


def mask_cost(llm: LLM, rounds: int) -> None:
    results: dict[bool, list[float]] = {False: [], True: []}
    for r in range(rounds):
        for guided in ((False, True) if r % 2 == 0 else (True, False)):
            results[guided].append(decode_step_ms(llm, guided))
    free, guided = (statistics.median(results[g]) for g in (False, True))
    print(f"decode step at batch 16: unguided {free:.2f} ms, every row guided {guided:.2f} ms "
          f"(x{guided / free:.2f}, median of {rounds} interleaved rounds)")


def compile_cost(llm: LLM) -> None:
    backend = llm.engine.structured_outputs()
    cold, cached = [], []
    for i in range(5):
        schema = dict(NESTED, properties={**NESTED["properties"], f"extra{i}": {"type": "integer"}})
        start = time.perf_counter()
        backend.compile(Spec(json=schema))
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        backend.compile(Spec(json=schema))
        cached.append(time.perf_counter() - start)
    print(f"compiling the nested schema: cold {statistics.median(cold) * 1e3:.1f} ms, "
          f"cached {statistics.median(cached) * 1e3:.3f} ms (median of 5)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--kinds", default="nested,json_object,regex,choice")
    parser.add_argument("--validity-only", action="store_true")
    parser.add_argument("--http", metavar="URL", default=None,
                        help="check validity through a running server (e.g. "
                             "http://127.0.0.1:8000), streamed and not, instead of in process")
    args = parser.parse_args()
    if args.http:
        http_validity(args.http.rstrip("/"), args.samples, args.kinds.split(","))
        return 0
    llm = LLM(args.model, max_num_seqs=64, max_model_len=1024)
    validity(llm, args.samples, args.kinds.split(","))
    if not args.validity_only:
        mask_cost(llm, args.rounds)
        compile_cost(llm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
