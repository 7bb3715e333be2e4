"""The command line: every flag ``hpu-serve`` had keeps its name, aliases, choices and default
(drop-in for vLLM), the help shows what the fields declare, and bad values stop start-up."""

from __future__ import annotations

import argparse
import contextlib
import io

import httpx
import pytest

from server.cli import build_parser, main
from server.config import (
    BatchOptions,
    BenchOptions,
    BucketFitOptions,
    EngineConfig,
    ServerConfig,
)
from server.config.fields import Source, spec_of, walk

# `hpu-serve {serve,buckets,bench}` before the flags were generated from the config fields:
# option strings = argparse default {choices}. Flags may be added; none may change or go.
PINNED = """
[serve]
--allow-credentials = False
--allowed-headers = ['*']
--allowed-methods = ['*']
--allowed-origins = ['*']
--api-key = None
--block-size = 128
--bucketing-strategy = None {exp,lin,adaptive}
--chat-template = None
--device = 'auto'
--disable-uvicorn-access-log = False
--distributed-executor-backend = 'mp' {mp,ray}
--dtype = 'auto' {auto,bfloat16,float16,float32}
--enable-auto-tool-choice = False
--enable-chunked-prefill --no-enable-chunked-prefill = True
--enable-prefix-caching --no-enable-prefix-caching = True
--enforce-eager = False
--execution-mode = 'auto' {auto,eager,compile,graphs}
--fair-share = 'address' {off,api-key,address}
--gpu-memory-utilization = 0.9
--grammar-cache-size = 256
--grammar-compile-timeout = 10.0
--grammar-workers = 2
--guided-decoding-backend --structured-outputs-backend --structured-outputs-config.backend = 'auto' {auto,xgrammar}
--health-stall-timeout = 120.0
--host = '0.0.0.0'
--kv-cache-dtype = 'auto' {auto,fp8,fp8_e4m3}
--limit-concurrency = 512
--max-client-seqs = 0
--max-grammar-alternatives = 1024
--max-grammar-bytes = 65536
--max-idle-connections-per-address = 64
--max-logit-bias = 1024
--max-logprobs = 20
--max-messages = 1024
--max-model-len = None
--max-num-batched-tokens = None
--max-num-seqs = 256
--max-prompts = 128
--max-request-body-bytes = 16777216
--max-seqs-per-request = 256
--max-stop-strings = 4
--max-stop-token-ids = 1024
--max-tokens-per-request = 131072
--max-waiting-requests = 1024
--model = None
--num-gpu-blocks-override = None
--port = 8000
--preprocess-workers = 4
--quantization -q = None {gguf,none,gptq,awq,fp8,compressed-tensors}
--reasoning-parser = None
--scheduling-policy = 'fcfs' {fcfs,priority}
--seed = 0
--served-model-name = None
--shutdown-timeout = 30.0
--tensor-parallel-size -tp = 1
--timeout-idle-connection = 5.0
--timeout-keep-alive = 5.0
--timeout-request-body = 30.0
--timeout-request-header = 20.0
--tool-call-parser = None
--uvicorn-log-level = 'info' {debug,info,warning,error,critical}
<positional> = None
[buckets]
--api-key = None
--block-size = 128
--enable-chunked-prefill --no-enable-chunked-prefill = True
--enable-prefix-caching --no-enable-prefix-caching = True
--from = None
--kv-weight = None
--max-buckets = None
--max-model-len = 4096
--max-num-batched-tokens = None
--max-num-seqs = 256
--num-gpu-blocks-override = None
--observed-only = False
--output -o = 'buckets.suggested.txt'
--query-step = None
--suggest = False
--warmup-budget = None
[bench]
--api-key = None
--base-url = 'http://127.0.0.1:8000'
--burstiness = 1.0
--endpoint = 'completions' {completions,chat}
--input-len = 200
--label = ''
--long-input-len = 4096
--long-prompt-fraction = 0.0
--max-concurrency = None
--model = None
--no-ignore-eos = True
--no-progress = True
--num-prompts = 100
--output-len = 128
--range-ratio = 0.0
--request-rate = inf
--result-file = None
--seed = 0
--shared-prefix-len = 0
--tokenizer = None
--turns = 1
--warmup-requests = 1
"""


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {" ".join(sorted(a.option_strings)) or "<positional>": a for a in parser._actions}


def pinned() -> list[tuple[str, str, str]]:
    rows, command = [], ""
    for line in PINNED.strip().splitlines():
        if line.startswith("["):
            command = line.strip("[]")
            continue
        flags, rest = line.split(" = ", 1)
        rows.append((command, flags, rest))
    return rows


@pytest.mark.parametrize(("command", "flags", "expected"), pinned())
def test_every_earlier_flag_keeps_its_names_default_and_choices(command: str, flags: str,
                                                                expected: str) -> None:
    action = actions(subparsers()[command]).get(flags)
    assert action is not None, f"hpu-serve {command}: {flags} is gone"
    default, _, pinned = expected.partition(" {")
    assert repr(action.default) == default
    # a flag may learn new values (--quantization mxfp4); none it took may go
    earlier = pinned.rstrip("}").split(",") if pinned else []
    assert set(earlier) <= set(action.choices or ()), f"{flags} lost a choice"
    assert not action.choices or earlier, f"{flags} now restricts its values"


def help_of(command: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main([command, "--help"])
    return out.getvalue()


@pytest.mark.parametrize(("command", "classes"), [
    ("serve", (EngineConfig, ServerConfig)), ("bench", (BenchOptions,)),
    ("run-batch", (EngineConfig, ServerConfig, BatchOptions)),
])
def test_help_shows_every_field_with_its_help_and_variable(command: str,
                                                           classes: tuple[type, ...]) -> None:
    text = " ".join(help_of(command).split())  # unwrapped
    for cls in classes:
        for _, f, _, _ in walk(cls):
            spec = spec_of(f)
            assert spec is not None
            if spec.source is Source.FLAG and not spec.positional:
                assert f"--{spec.flag_name(f.name)}" in text
            if spec.source in (Source.FLAG, Source.KNOB):
                assert " ".join(spec.help.split()[:6]) in text, f.name
            if isinstance(spec.env, str):
                assert spec.env in text, f.name


def test_buckets_reuses_serves_flags_with_a_plan_default() -> None:
    args = subparsers()["buckets"].parse_args(["--max-num-seqs", "8", "--from", "x.json"])
    assert (args.max_model_len, args.max_num_seqs, args.source) == (4096, 8, "x.json")
    with pytest.raises(SystemExit):  # one budget or the other
        subparsers()["buckets"].parse_args(["--max-buckets", "4", "--warmup-budget", "9"])


def test_bench_options_come_from_the_dataclass() -> None:
    from server.config.fields import build

    parser = subparsers()["bench"]
    assert build(BenchOptions, parser.parse_args([]), {}) == BenchOptions()
    opts = build(BenchOptions, parser.parse_args(["--no-ignore-eos", "--no-progress",
                                                  "--endpoint", "chat"]), {})
    assert (opts.ignore_eos, opts.progress, opts.endpoint) == (False, False, "chat")


def test_fit_options_default_to_the_dataclass() -> None:
    from server.config.fields import build

    args = subparsers()["buckets"].parse_args([])
    assert build(BucketFitOptions, args, {}) == BucketFitOptions()


def test_a_bad_value_stops_serve_before_loading_with_one_line(monkeypatch) -> None:
    with pytest.raises(SystemExit, match="error: --block-size must be >= 1"):
        main(["serve", "--block-size", "0"])
    monkeypatch.setenv("VLLM_GRAPH_RESERVED_MEM", "lots")
    with pytest.raises(SystemExit, match="error: VLLM_GRAPH_RESERVED_MEM must be a number"):
        main(["serve"])


def test_an_unknown_grammar_backend_is_refused(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--structured-outputs-backend", "outlines"])
    assert exc.value.code == 2
    assert "invalid choice: 'outlines'" in capsys.readouterr().err


VLLM_COMMAND_LINE = ["--trust-remote-code", "--swap-space", "16", "--load-format", "auto",
                     "--disable-log-requests", "--disable-log-stats",
                     "--disable-frontend-multiprocessing", "--disable-custom-all-reduce",
                     # flags with an effect, as a vLLM deployment spells them
                     "--enable-prompt-tokens-details", "--generation-config", "auto",
                     "--enable-server-load-tracking", "--api-server-count", "1",
                     "--revision", "main"]


@pytest.mark.slow
def test_a_vllm_command_line_starts_and_says_what_is_ignored(tiny_model) -> None:
    """vLLM flags with no effect here are accepted, each set one logged once with why."""
    from server_process import TINY_FLAGS, start_server

    srv = start_server(tiny_model[0], *TINY_FLAGS, *VLLM_COMMAND_LINE)
    try:
        assert httpx.get(srv.base_url + "/health", timeout=30).status_code == 200
        assert httpx.get(srv.base_url + "/load", timeout=30).json() == {"server_load": 0}
    finally:
        srv.stop()
    log = srv.log()
    assert "has no effect here" not in log.replace(  # only the four no-effect flags warn
        "--trust-remote-code True has no effect here", "").replace(
        "--swap-space 16.0 has no effect here", "").replace(
        "--disable-frontend-multiprocessing True has no effect here", "").replace(
        "--disable-custom-all-reduce True has no effect here", ""), log[-3000:]
    for flag in ("--trust-remote-code True", "--swap-space 16.0",
                 "--disable-frontend-multiprocessing True", "--disable-custom-all-reduce True"):
        assert log.count(f"{flag} has no effect here") == 1, log[-3000:]
    assert "--load-format auto has no effect" not in log  # the default says nothing


def test_a_vllm_flag_that_would_change_answers_is_refused(capsys) -> None:
    """Not implemented and not harmless: start-up stops naming it."""
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--long-lora-scaling-factors", "4.0"])
    assert exc.value.code == 2
    assert "--long-lora-scaling-factors" in capsys.readouterr().err


def test_the_offline_llm_takes_vllm_keywords_and_warns(tiny_model) -> None:
    import logging

    from server import LLM, SamplingParams

    # a handler of the test's own: the server's may write to an earlier test's stderr
    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("server.engine.llm")
    logger.addHandler(handler)
    try:
        llm = LLM(tiny_model[0], trust_remote_code=True, dtype="float32", block_size=16,
                  max_model_len=64, max_num_seqs=2)
    finally:
        logger.removeHandler(handler)
    assert any("--trust-remote-code True has no effect here" in m for m in messages), messages
    assert llm.generate(["the"], SamplingParams(max_tokens=1))
