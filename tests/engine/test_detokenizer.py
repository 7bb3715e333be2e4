"""Incremental detokenization and stop strings on byte-level and sentencepiece tokenizers."""

from __future__ import annotations

import pytest

from server.engine.detokenizer import IncrementalDetokenizer
from server.engine.tokenizer import Tokenizer

TEXTS = [
    "Hello world, how are you?",
    "héllo wörld ünïcode naïve café",
    "日本語のテキスト と 中文 🙂🚀 emoji",
    "  leading spaces and\nnew lines\ttabs",
]


def metaspace_tokenizer() -> Tokenizer:
    """A sentencepiece-style (▁ for spaces, byte fallback) BPE trained in memory."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    raw.normalizer = normalizers.Replace(" ", "▁")
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    raw.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(content=" ", left=1, right=0),
    ])
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"] + byte_tokens,
                                  show_progress=False)
    raw.train_from_iterator([t for t in TEXTS for _ in range(5)] + ["the cat sat on the mat"] * 5,
                            trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                                 unk_token="<unk>")
    return Tokenizer.from_hf(hf)


def byte_level_tokenizer():
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    raw.train_from_iterator(TEXTS * 5, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module", params=["byte-level", "sentencepiece", "smollm2"])
def tokenizer(request, smollm2_gguf) -> Tokenizer:
    if request.param == "byte-level":
        return Tokenizer.from_hf(byte_level_tokenizer())
    if request.param == "smollm2":
        return Tokenizer.from_model_path(smollm2_gguf[0], gguf_file=smollm2_gguf[1])
    if request.param == "sentencepiece":
        return metaspace_tokenizer()
    raise AssertionError


def stream(tok: Tokenizer, prompt: list[int], ids: list[int], **kw) -> tuple[list[str], str, IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, prompt, **kw)
    deltas = []
    for token_id in ids:
        update = detok.update([token_id])
        deltas.append(update.delta_text)
        if update.stop_string is not None:
            break
    return deltas, detok.flush(), detok


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_full_decode(tokenizer: Tokenizer, text: str) -> None:
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    ids = tokenizer.encode(" " + text, add_special_tokens=False)
    deltas, rest, _ = stream(tokenizer, prompt, ids)
    full = tokenizer.decode(prompt + ids)
    assert "".join(deltas) + rest == full[len(tokenizer.decode(prompt)):]
    assert not any("\ufffd" in d for d in deltas)


def test_stop_string_across_tokens(tokenizer: Tokenizer) -> None:
    text = " alpha beta gamma delta"
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, rest, detok = stream(tokenizer, [], ids, stop=["a gam"])
    out = "".join(deltas) + rest
    assert out == tokenizer.decode(ids)[: tokenizer.decode(ids).index("a gam")]
    assert "gam" not in out and detok.text == out

    deltas, rest, _ = stream(tokenizer, [], ids, stop=["a gam"], include_stop_str_in_output=True)
    full = tokenizer.decode(ids)
    assert "".join(deltas) + rest == full[: full.index("a gam") + len("a gam")]


def test_hold_back_and_flush_without_match(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(" the cat sat on the mat", add_special_tokens=False)
    deltas, rest, _ = stream(tokenizer, [], ids, stop=["zzzzzz"])
    assert len(rest) > 0  # the tail was held back in case it began the stop string
    assert "".join(deltas) + rest == tokenizer.decode(ids)


def test_stop_at_the_very_start(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    deltas, rest, detok = stream(tokenizer, [], ids, stop=["Hel"])
    assert "".join(deltas) + rest == "" and detok.text == ""
