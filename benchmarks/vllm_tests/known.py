"""What the shim knows about vLLM's tests before running them: which are not applicable to
hpu-serve (and why), and how each failure seen on the last run is classified. run.py prints
any failure not listed here as "unclassified"."""

from __future__ import annotations

from enum import Enum

NA_PREFIX = "not applicable: "

AUDIO = ("speech to text (Whisper's /v1/audio/transcriptions and translations); hpu-serve "
         "serves text models, and the test's audio is fetched from the hub")
VLLM_UNIT = "a unit test of vLLM's internal Python objects, not of the HTTP server"
SDK_VERSION = ("compares openai's model_dump() keys with the wire's: openai 3.57 (installed "
               "here) declares metadata and moderation, which neither vLLM nor hpu-serve sends "
               "(vLLM fails it too); tests/api/test_sagemaker.py checks the keys on the wire")

# (file, part of the test id) -> reason
NOT_APPLICABLE: dict[tuple[str, str], str] = {
    ("basic/test_basic.py", "test_health_check_engine_dead_error"): VLLM_UNIT,
    ("chat_completion/test_chat.py", "test_chat_completion_request_n_parameter"): VLLM_UNIT,
    ("chat_completion/test_chat.py", "test_invocations"): SDK_VERSION,
    ("openai/test_run_batch.py", "test_transcription"): AUDIO,
    ("openai/test_run_batch.py", "test_translation"): AUDIO,
}


def not_applicable(nodeid: str) -> str | None:
    for (path, part), reason in NOT_APPLICABLE.items():
        if path in nodeid and part in nodeid:
            return reason
    return None


class Kind(Enum):
    MODEL_SPECIFIC = "model-specific"
    MISSING_FEATURE = "missing feature"
    BEHAVIOUR = "behaviour difference"
    # the per-test timeout of this run fired: nothing about the server is known from it
    NOT_FINISHED = "not finished here"
    # the test's own environment, not the server (vLLM would fail it the same way here)
    HARNESS = "harness"


TIMEOUT_REASON = ("the run's per-test timeout (or the client's 600 s one) fired: on the 2 "
                  "CPU cores shared with other test runs (load 5-17) the engine made ~0.2-3 "
                  "steps/s (the slowest with --enable-lora), and the test asks for up to 1000 "
                  "tokens, or runs to the model's EOS without max_tokens")


# part of the test id -> (kind, reason); filled from the last run (REPORT.md)
FAILURES: dict[str, tuple[Kind, str]] = {
    "completion/test_completion.py::test_single_completion": (
        Kind.MODEL_SPECIFIC, "expects 6 prompt tokens for \"Hello, my name is\": OPT's "
        "tokenizer prepends </s>; SmolLM2's adds no BOS (5 tokens)"),
    "completion/test_completion.py::test_completion_streaming": (
        Kind.MODEL_SPECIFIC, "expects the 5-token answer to \"What is an LLM?\" to be cut "
        "by max_tokens; SmolLM2-135M's greedy answer ends (EOS) within 5 tokens"),
    "chat_completion/test_chat.py::test_single_chat_session": (
        Kind.MODEL_SPECIFIC, "expects zephyr's 37 prompt tokens (its template and tokenizer)"),
    "chat_completion/test_chat.py::test_more_than_one_prompt_logprobs_chat": (
        Kind.MODEL_SPECIFIC, "expects one entry at prompt position 3 for prompt_logprobs=1: "
        "vLLM's entry holds the top 1 and the prompt's own token when that is not the top 1 "
        "(so 1 or 2 entries); under zephyr's template and weights it is the top 1, under "
        "SmolLM2's it is not (2 entries, as vLLM would give)"),
    "chat_completion/test_chat.py::test_structured_outputs_choice_chat": (
        Kind.MODEL_SPECIFIC, "expects the model to follow \"pick another one\"; SmolLM2 "
        "picked TypeScript twice (the choice constraint held both times)"),
    "chat_completion/test_chat.py::test_response_format_json_object": (
        Kind.MODEL_SPECIFIC, "expects {\"result\": 2}; SmolLM2 wrote other valid JSON (the "
        "json_object constraint held)"),
    "chat_completion/test_chat.py::test_complex_message_content": (
        Kind.MODEL_SPECIFIC, "expects zephyr's exact answer \"2\"; SmolLM2 said "
        "\"1 + 1 = 2\""),
    "chat_completion/test_chat.py::test_custom_role": (
        Kind.NOT_FINISHED, "the client's 600 s timeout fired: the request has no max_tokens, "
        "SmolLM2's greedy answer to it runs past 400 tokens (checked on a server of its own: "
        "\"1+1 is a mathematical concept that has been debated by philosophers...\"), and "
        "test_chat.py's server, which serves a LoRA adapter too, made ~0.5 tokens/s here"),
    "test_root_path.py::test_chat_session_root_path_with_api_key[test_case2]": (
        Kind.NOT_FINISHED, "the client's 600 s timeout fired: the request samples (no "
        "temperature) with no max_tokens; SmolLM2's continuations of the saying ran 150, 371 "
        "and over 400 tokens on three seeds (checked on a server of its own), too long for "
        "this shared CPU within 600 s"),
    "responses/test_basic.py::test_simple_input": (
        Kind.MODEL_SPECIFIC, "expects Qwen3-1.7B's answer (\"312\" for 13 * 24) and a "
        "reasoning item (Qwen3 thinks in <think>; SmolLM2-135M does neither); its run here "
        "did not finish within the per-test timeout (no max_output_tokens), which would not "
        "change that"),
    "responses/test_basic.py::test_instructions": (
        Kind.MODEL_SPECIFIC, "expects Qwen3-1.7B's arithmetic (\"312\") and that it "
        "follows the instruction to end with QED"),
    "responses/test_basic.py::test_chat": (
        Kind.MODEL_SPECIFIC, "expects Qwen3-1.7B's arithmetic (\"30\" for 15 x 2); "
        "SmolLM2-135M answered \"45. QED.\""),
    "responses/test_simple.py::test_reasoning_item": (
        Kind.MODEL_SPECIFIC, "expects Qwen3-8B to think (a reasoning output item through "
        "--reasoning-parser qwen3); SmolLM2-135M writes no <think>, so the output is a "
        "message alone"),
    "responses/test_simple.py::test_streaming_reasoning_tokens_e2e": (
        Kind.MODEL_SPECIFIC, "expects Qwen3's reasoning tokens (usage reasoning_tokens > 0); "
        "SmolLM2-135M does not think"),
    "responses/test_simple.py::test_non_streaming_reasoning_tokens_e2e": (
        Kind.MODEL_SPECIFIC, "expects Qwen3's reasoning tokens (usage reasoning_tokens > 0); "
        "SmolLM2-135M does not think"),
    "test_run_batch.py::test_reasoning_parser": (
        Kind.MODEL_SPECIFIC, "expects Qwen3-0.6B's <think> reasoning through --reasoning-parser "
        "qwen3; SmolLM2-135M writes none, so message.reasoning is null"),
}


def classify(nodeid: str, message: str = "") -> tuple[Kind, str] | None:
    for part, verdict in FAILURES.items():
        if part in nodeid:
            return verdict
    if message.startswith(("Failed: Timeout", "openai.APITimeoutError")):
        return Kind.NOT_FINISHED, TIMEOUT_REASON
    return None
