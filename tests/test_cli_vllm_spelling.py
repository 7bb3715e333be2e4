"""vLLM's spellings of a command line, as its own tests start servers: underscores in option
names, dotted config fields, and flags that mean nothing here."""

from __future__ import annotations

from server.cli import build_parser, vllm_spelling
from server.config import engine_config_from_args, server_config_from_args
from server.config.compat import ignored_flags


def serve_args(*argv: str):
    return build_parser().parse_args(vllm_spelling(["serve", *argv]))


def test_underscored_options_read_as_dashed_and_values_stay() -> None:
    args = serve_args("--max_model_len", "5000", "--max_num_seqs=8",
                      "--served_model_name", "org/my_model")
    assert args.max_model_len == 5000
    assert args.max_num_seqs == 8
    assert args.served_model_name == "org/my_model"  # a value keeps its underscores


def test_dotted_structured_outputs_backend() -> None:
    args = serve_args("--structured-outputs-config.backend", "xgrammar")
    assert engine_config_from_args(args).structured_outputs.backend.value == "xgrammar"


def test_show_hidden_metrics_is_accepted_and_said_to_do_nothing() -> None:
    args = serve_args("--show-hidden-metrics-for-version=0.10")
    server_config_from_args(args)
    lines = ignored_flags(engine_config_from_args(args).vllm_no_op)
    assert any(line.startswith("--show-hidden-metrics-for-version 0.10 has no effect")
               for line in lines), lines
