"""Served image prompts, hpu-serve against vLLM's CPU backend, same LLaVA folder, one run.

    PYTHONPATH=. python benchmarks/compare/images_serving.py [--requests 16] [--rounds 3]
        [--dtype float32] [--hpu-serve-args ...]

Both servers serve the random LLaVA that ``benchmarks/images.py`` builds (CLIP tower 6 x 256,
112-pixel images in 14-pixel patches: 64 image tokens; Llama 6 x 512), saved once in
``.bench-cache/llava``, with a chat template that writes ``<image>`` where each image part
goes, the same dtype, ``--max-model-len`` and ``--max-num-seqs``; vLLM's OpenMP threads are
bound to the first ``--threads`` cores. Each request is ``/v1/chat/completions`` with one
PNG data URI (its own random image, 80-400 pixels a side: no encoder cache hit) and 64 text
tokens, ``max_tokens`` 1, streamed: TTFT is the time to the chunk that carries the token.
Concurrency 1 sends the requests one at a time, concurrency 16 all at once. Both servers are up at once
and take turns round by round (A/B, then B/A); prints medians of images/s and mean TTFT,
and their ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from compare import Server, free_port, python_has, thread_envs  # noqa: E402
from images import build_llava, images, prompt_text  # noqa: E402

from tests.vision.vision_helpers import VISION_TEMPLATE  # noqa: E402


def servers(args: argparse.Namespace, folder: Path, template: Path) -> list[Server]:
    common = ["--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
              "--max-num-seqs", "16", "--chat-template", str(template),
              "--limit-mm-per-prompt", '{"image": 1}', "--host", "127.0.0.1"]
    ours, theirs = thread_envs(args.threads, 1, pin=not args.no_pin)
    found = [Server("hpu-serve", [sys.executable, "-m", "server", "serve", str(folder), *common,
                                  "--port", str(port := free_port()), *args.hpu_serve_args],
                    port, env=ours)]
    if args.no_vllm:
        return found
    if not python_has(args.vllm_python, "vllm"):
        sys.exit(f"vllm: not installed at {args.vllm_python} "
                 "(WITH_VLLM=1 benchmarks/compare/setup_peers.sh)")
    found.append(Server("vllm", [
        args.vllm_python, str(Path(__file__).with_name("vllm_cpu_cli.py")), "serve",
        str(folder), *common, "--port", str(port := free_port())], port,
        env=theirs))
    return found


def png_uri(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


async def one(client: httpx.AsyncClient, server: Server, uri: str, text: str) -> float:
    """Seconds from sending to the chunk that carries the token of a 1-token answer."""
    body = {"model": server.model, "max_tokens": 1, "temperature": 0.0, "stream": True,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": uri}},
                {"type": "text", "text": text}]}]}
    began = time.perf_counter()
    first = None
    async with client.stream("POST", server.url + "/v1/chat/completions", json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{server.name}: {reply.status_code} {await reply.aread()!r}")
        async for line in reply.aiter_lines():
            if first is not None or not line.startswith("data: {"):
                continue
            # the first chunk that carries the token: not the opening role chunk (whose
            # content is ""); a token that decodes to "" still ends with a finish_reason
            choices = json.loads(line[6:]).get("choices") or [{}]
            if choices[0].get("delta", {}).get("content") or choices[0].get("finish_reason"):
                first = time.perf_counter() - began
    if first is None:
        raise RuntimeError(f"{server.name}: no content chunk")
    return first


def run(server: Server, uris: list[str], text: str, concurrency: int) -> tuple[float, float]:
    """(images/s, mean TTFT s): ``uris`` in batches of ``concurrency`` sent at once."""
    async def go() -> tuple[float, float]:
        ttfts: list[float] = []
        async with httpx.AsyncClient(timeout=600) as client:
            began = time.perf_counter()
            for i in range(0, len(uris), concurrency):
                ttfts += await asyncio.gather(*(one(client, server, u, text)
                                                for u in uris[i:i + concurrency]))
            return len(uris) / (time.perf_counter() - began), statistics.mean(ttfts)
    return asyncio.run(go())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16, help="images per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2, help="OpenMP threads of each server")
    parser.add_argument("--no-pin", action="store_true",
                        help="vLLM's threads float (nobind) like hpu-serve's: for a loaded host")
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm/bin/python"))
    parser.add_argument("--result-file", default=None)
    parser.add_argument("--no-vllm", action="store_true",
                        help="hpu-serve alone (vLLM 0.32.0 CPU cannot load LLaVA without "
                             "torchvision: see docs/images.md)")
    parser.add_argument("--hpu-serve-args", nargs=argparse.REMAINDER, default=[],
                        help="extra flags for hpu-serve (must come last)")
    args = parser.parse_args()
    folder = ROOT / ".bench-cache" / "llava"
    if not (folder / "config.json").exists():
        build_llava(folder)
    template = folder.parent / "llava-chat-template.jinja"
    template.write_text(VISION_TEMPLATE)
    from transformers import AutoTokenizer

    text = prompt_text(AutoTokenizer.from_pretrained(folder)).removeprefix("<image>\n")
    found = servers(args, folder, template)
    results: dict[str, dict[int, list[tuple[float, float]]]] = {
        s.name: {c: [] for c in args.concurrency} for s in found}
    logs = tempfile.mkdtemp(prefix="hpu-serve-compare-")
    print(f"server logs in {logs}", flush=True)
    try:
        for server in found:
            server.start(Path(logs))
            print(f"{server.name}: ready in {server.ready_s:.1f} s", flush=True)
            run(server, [png_uri(i) for i in images(2, 99)], text, 2)  # warm
        for r in range(args.rounds):
            for conc in args.concurrency:
                uris = [png_uri(i) for i in images(args.requests, seed=1000 * conc + r)]
                order = found if (r + conc) % 2 == 0 else found[::-1]
                for server in order:
                    rate, ttft = run(server, uris, text, conc)
                    results[server.name][conc].append((rate, ttft))
                    print(f"round {r + 1} conc {conc:>2} {server.name:<9} {rate:6.2f} "
                          f"images/s  TTFT {ttft * 1e3:8.1f} ms", flush=True)
    finally:
        for server in found:
            server.stop()
    print(f"\nmedians over {args.rounds} rounds of {args.requests} images, 1 image + 64 text "
          "tokens, 1 output token")
    for conc in args.concurrency:
        med = {n: (statistics.median(x[0] for x in rows[conc]),
                   statistics.median(x[1] for x in rows[conc])) for n, rows in results.items()}
        for name, (rate, ttft) in med.items():
            print(f"conc {conc:>2} {name:<9} {rate:6.2f} images/s  TTFT {ttft * 1e3:8.1f} ms")
        if "vllm" not in med:
            continue
        ours, theirs = med["hpu-serve"], med["vllm"]
        print(f"conc {conc:>2} hpu-serve / vllm: images/s {ours[0] / theirs[0]:.2f}x, "
              f"TTFT {ours[1] / theirs[1]:.2f} (below 1: hpu-serve faster)")
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(
            {"args": vars(args), "results": results,
             "ready_s": {s.name: s.ready_s for s in found}}, indent=2))


if __name__ == "__main__":
    main()
