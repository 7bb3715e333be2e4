"""Bucket planning reproduces the source documents' worked examples exactly."""

from __future__ import annotations

import ast
import re
from itertools import product
from pathlib import Path

import pytest

from server.config import bucketing_config_from_env
from server.hpu.buckets.lookup import ShapePlanner
from server.hpu.buckets.plan import (
    BucketRanges,
    decode_buckets,
    exp_range,
    format_plan,
    lin_range,
    parse_bucket_file,
    prefill_buckets,
    resolve_ranges,
)
from server.hpu.counters import DeviceCounters
from server.hpu.types import Phase

# The specification of record lives beside the checkout (../shared/reference/seeds).
SEEDS = Path(__file__).resolve().parents[3].parent / "shared" / "reference" / "seeds"


def bucketing_config(env: dict[str, str], **limits: int) -> BucketRanges:
    """The plan an environment gives for these engine limits."""
    return resolve_ranges(bucketing_config_from_env(env), **limits)


def test_linear_ranges_of_the_docs() -> None:
    assert lin_range(2, 32, 64) == [2, 4, 8, 16, 32, 64]
    assert lin_range(128, 128, 512) == [128, 256, 384, 512]
    assert lin_range(0, 1, 7) == [1, 2, 3, 4, 5, 6, 7, 0]
    assert lin_range(128, 128, 1000)[-1] == 896  # max kept only on the step grid


def test_exponential_seq_range_of_the_docs() -> None:
    assert exp_range(128, 128, 1024, 11) == [128, 256, 384, 512, 640, 768, 896, 1024]


LOGGED_PROMPT = [(bs, q) for bs in (1, 2, 4) for q in range(128, 1025, 128)]
LOGGED_DECODE = [(bs, s) for bs in (1, 2, 4) for s in range(128, 2049, 128)]


def test_linear_strategy_reproduces_the_logged_pairs() -> None:
    # bs [1, 32, 4] x seq [128, 128, 1024] -> 24 prompt; bs [1, 128, 4] x [128, 128, 2048] -> 48
    prompt = list(product(lin_range(1, 32, 4), lin_range(128, 128, 1024)))
    decode = list(product(lin_range(1, 128, 4), lin_range(128, 128, 2048)))
    assert prompt == LOGGED_PROMPT
    assert len(prompt) == 24
    assert decode == LOGGED_DECODE
    assert len(decode) == 48
    env = {"VLLM_BUCKETING_STRATEGY": "lin", "VLLM_PROMPT_BS_BUCKET_STEP": "32",
           "VLLM_PROMPT_BS_BUCKET_MAX": "4", "VLLM_PROMPT_SEQ_BUCKET_MAX": "1024"}
    cfg = bucketing_config(env, block_size=128, max_model_len=2048, max_num_seqs=4,
                           max_num_batched_tokens=4096)
    assert [(b[0], b[1]) for b in prefill_buckets(cfg)] == LOGGED_PROMPT


@pytest.mark.skipif(not SEEDS.is_dir(),
                    reason=f"skipped: the reference documents are not at {SEEDS} (they sit "
                           "beside the checkout, in ../shared/reference/seeds)")
def test_logged_lists_in_the_source_document_match() -> None:
    text = (SEEDS / "000_646bb412a6b8ce59.txt").read_text()
    logged = re.search(r"Generated 24 prompt buckets: (\[.*?\])\n", text).group(1)
    assert ast.literal_eval(logged) == LOGGED_PROMPT


def test_exponential_defaults_match_the_reference_numbers() -> None:
    cfg = bucketing_config({}, block_size=128, max_model_len=1024, max_num_seqs=4,
                           max_num_batched_tokens=1024)
    assert [b[1] for b in prefill_buckets(cfg)] == [128, 256, 384, 512, 768, 896, 1024]
    assert decode_buckets(cfg) == [
        (1, 1, 1), (1, 1, 4), (1, 1, 8), (2, 1, 4), (2, 1, 8), (2, 1, 12), (2, 1, 16),
        (4, 1, 4), (4, 1, 8), (4, 1, 12), (4, 1, 16), (4, 1, 24), (4, 1, 32)]
    plan = format_plan(cfg)
    assert "Prompt bucket config (min, step, max_warmup, limit) bs:[1, 2, 1, 1], " \
           "seq:[128, 128, 1024, 10]" in plan
    assert "Generated 13 decode buckets [bs, query, num_blocks]:" in plan


def test_legacy_switch_and_env_overrides_select_linear() -> None:
    kw = dict(block_size=128, max_model_len=1024, max_num_seqs=64, max_num_batched_tokens=2048)
    assert bucketing_config({"VLLM_EXPONENTIAL_BUCKETING": "false"}, **kw).strategy == "lin"
    cfg = bucketing_config({"VLLM_BUCKETING_STRATEGY": "lin", "VLLM_DECODE_BS_BUCKET_STEP": "16",
                            "VLLM_DECODE_BS_BUCKET_MAX": "32"}, **kw)
    assert sorted({b[0] for b in decode_buckets(cfg)}) == [1, 2, 4, 8, 16, 32]
    with pytest.raises(ValueError, match="VLLM_DECODE_BS_BUCKET_MAX"):
        bucketing_config({"VLLM_BUCKETING_STRATEGY": "lin", "VLLM_DECODE_BS_BUCKET_MAX": "x"}, **kw)


def test_impossible_buckets_are_filtered() -> None:
    env = {"VLLM_BUCKETING_STRATEGY": "lin", "VLLM_PROMPT_BS_BUCKET_MAX": "8"}
    cfg = bucketing_config(env, block_size=128, max_model_len=1024, max_num_seqs=8,
                           max_num_batched_tokens=1024)
    assert all(bs * q <= 1024 for bs, q, _ in prefill_buckets(cfg))  # token budget
    assert all(bs <= blocks <= bs * 8 for bs, _, blocks in decode_buckets(cfg))


def test_the_three_file_examples(tmp_path: Path) -> None:
    def parse(text: str) -> list[tuple[int, int, int]]:
        path = tmp_path / "b.txt"
        path.write_text(text)
        return parse_bucket_file(str(path))

    assert parse("(1, 2048, 0)\n(64, 1, 1024)\n") == [(1, 2048, 0), (64, 1, 1024)]
    assert parse("(1, [256, 512], [0, 4, 8])") == [
        (1, 256, 0), (1, 256, 4), (1, 256, 8), (1, 512, 0), (1, 512, 4), (1, 512, 8)]
    # range() is end-exclusive, as in Python (the document's prose says 512 too; it is not)
    assert parse("# comment\n\n(1, 1, range(256, 512, 128))\n") == [(1, 1, 256), (1, 1, 384)]
    with pytest.raises(ValueError, match=r"b\.txt:2: bad bucket line"):
        parse("(1, 128, 0)\n(1, __import__('os'), 0)\n")


def test_padding_example_of_the_bucketing_document() -> None:
    env = {"VLLM_BUCKETING_STRATEGY": "lin", "VLLM_PROMPT_BS_BUCKET_MAX": "4",
           "VLLM_PROMPT_BS_BUCKET_STEP": "32"}
    cfg = bucketing_config(env, block_size=128, max_model_len=2048, max_num_seqs=4,
                           max_num_batched_tokens=4096)
    planner = ShapePlanner(prefill_buckets(cfg), decode_buckets(cfg), DeviceCounters("m"))
    # 3 sequences of 412 tokens -> prefill bucket (4, 512, 0)
    assert planner.find(Phase.PREFILL, 3, 412) == (4, 512, 0)
    # decode: 3 rows of 4 blocks each -> batch 4; as requests finish -> batch 2
    assert planner.find(Phase.DECODE, 3, 12)[0] == 4
    assert planner.find(Phase.DECODE, 2, 8)[0] == 2
    # beyond every bucket: no bucket, the caller runs it as is and counts a miss
    assert planner.find(Phase.PREFILL, 1, 4096) is None
    assert planner.pad(Phase.PREFILL, 1, 4096) == (1, 4096, 0)
    assert planner.counters._misses.labels("m", "prefill")._value.get() == 1


def test_shipped_example_bucket_file_parses() -> None:
    example = Path(__file__).resolve().parents[3] / "config" / "buckets.example.txt"
    buckets = parse_bucket_file(str(example))
    prompts = [b for b in buckets if b[1] != 1]
    decodes = [b for b in buckets if b[1] == 1]
    assert (1, 2048, 0) in prompts
    assert (4, 256, 0) in prompts
    assert (1, 512, 31) in prompts  # a context line
    assert len(prompts) == 9 + 3 * 6
    assert (8, 1, 104) in decodes
    assert (32, 1, 480) in decodes
    assert all(blocks < 544 for _, _, blocks in decodes)


def test_context_dimension_for_chunked_prefill_and_prefix_caching() -> None:
    env = bucketing_config_from_env({})
    limits = dict(block_size=128, max_model_len=4096, max_num_seqs=16,
                  max_num_batched_tokens=2048, num_blocks=200)
    plain = prefill_buckets(resolve_ranges(env, **limits))
    ranges = resolve_ranges(env, **limits, with_context=True)
    buckets = prefill_buckets(ranges)
    # the context-free buckets are unchanged; the new ones are bs 1, context up to the
    # longest a one-block query can follow: (4096 - 128) / 128 = 31 blocks
    assert [b for b in buckets if b[2] == 0] == plain
    with_ctx = [b for b in buckets if b[2] > 0]
    assert {b[0] for b in with_ctx} == {1}
    assert sorted({b[2] for b in with_ctx}) == [1, 2, 4, 8, 16, 31]
    assert "ctx:[0, 1, 31, 6]" in format_plan(ranges)
    # linear strategy: the reference's VLLM_PROMPT_CTX_BUCKET_* knobs
    lin = bucketing_config_from_env({"VLLM_BUCKETING_STRATEGY": "lin",
                                     "VLLM_PROMPT_CTX_BUCKET_MIN": "0",
                                     "VLLM_PROMPT_CTX_BUCKET_STEP": "8",
                                     "VLLM_PROMPT_CTX_BUCKET_MAX": "24"})
    lin_buckets = prefill_buckets(resolve_ranges(lin, **limits, with_context=True))
    assert sorted({b[2] for b in lin_buckets}) == [0, 8, 16, 24]
    # lookups take the context into account; a prefill with context never pads into a
    # bucket of another batch size
    planner = ShapePlanner(buckets, [], DeviceCounters("m"))
    assert planner.pad(Phase.PREFILL, 1, 300, 5) == (1, 384, 8)
    assert planner.pad(Phase.PREFILL, 1, 300, 0) == (1, 384, 0)
