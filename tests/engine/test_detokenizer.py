"""Incremental detokenization and stop strings on byte-level and sentencepiece tokenizers."""

from __future__ import annotations

import json

import pytest

from server.engine.detokenizer import IncrementalDetokenizer
from server.engine.tokenizer import Tokenizer

TEXTS = [
    "Hello world, how are you?",
    "héllo wörld ünïcode naïve café",
    "日本語のテキスト と 中文 🙂🚀 emoji",
    "  leading spaces and\nnew lines\ttabs",
]
# Characters none of the tiny tokenizers saw in training: they split into byte tokens.
RARE = "go 𝄞 ж ∮ 🦀 ok Ω≈ç"


def metaspace_tokenizer() -> Tokenizer:
    """A sentencepiece-style BPE (▁ for spaces, byte fallback), trained in memory."""
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
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    raw.train_from_iterator(TEXTS * 5 + ["the cat sat on the mat"] * 5, trainer)
    # Byte tokens <0x00>..<0xFF> as ordinary vocabulary (as in Llama's), not special tokens
    # that skip_special_tokens would drop.
    spec = json.loads(raw.to_str())
    vocab = spec["model"]["vocab"]
    for i in range(256):
        vocab.setdefault(f"<0x{i:02X}>", len(vocab))
    hf = PreTrainedTokenizerFast(tokenizer_object=RawTokenizer.from_str(json.dumps(spec)),
                                 bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    return Tokenizer.from_hf(hf)


def byte_level_tokenizer() -> Tokenizer:
    """A GPT-2-style byte-level BPE, trained in memory."""
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
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>")
    return Tokenizer.from_hf(hf)


@pytest.fixture(scope="module", params=["byte-level", "sentencepiece", "smollm2"])
def tokenizer(request) -> Tokenizer:
    if request.param == "byte-level":
        return byte_level_tokenizer()
    if request.param == "sentencepiece":
        return metaspace_tokenizer()
    return request.getfixturevalue("smollm2_tokenizer")


def stream(tok: Tokenizer, prompt: list[int], ids: list[int], chunk: int = 1,
           **kw) -> tuple[list[str], str, IncrementalDetokenizer]:
    """Feeds ``ids`` ``chunk`` at a time until a stop string; returns deltas, flush, detok."""
    detok = IncrementalDetokenizer(tok, prompt, **kw)
    deltas = []
    for i in range(0, len(ids), chunk):
        update = detok.update(ids[i : i + chunk])
        deltas.append(update.delta_text)
        if update.stop_string is not None:
            break
    return deltas, detok.flush(), detok


def generated_text(tok: Tokenizer, prompt: list[int], ids: list[int], **kw) -> str:
    """What the full decode adds after the prompt: the reference for streaming."""
    return tok.decode(prompt + ids, **kw)[len(tok.decode(prompt, **kw)):]


@pytest.mark.parametrize("text", [*TEXTS, RARE])
@pytest.mark.parametrize("chunk", [1, 3])
def test_streaming_equals_full_decode(tokenizer: Tokenizer, text: str, chunk: int) -> None:
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    ids = tokenizer.encode(" " + text, add_special_tokens=False)
    deltas, rest, detok = stream(tokenizer, prompt, ids, chunk=chunk)
    expected = generated_text(tokenizer, prompt, ids)
    assert "".join(deltas) + rest == expected == detok.text
    assert rest == ""  # every character was complete, so nothing waited for flush
    assert not any("\ufffd" in d for d in deltas)


def test_multibyte_characters_split_over_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(RARE, add_special_tokens=False)
    # The case is really exercised: some tokens hold only part of a character.
    assert any("\ufffd" in tokenizer.token_str(i) for i in ids)
    deltas, rest, _ = stream(tokenizer, [], ids)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert rest == ""
    for ch in "𝄞ж∮🦀":
        # each came out whole, with the token that carried its last byte
        assert any(d.endswith(ch) for d in deltas)


def test_unfinished_character_waits_then_flushes(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ab 🦀", add_special_tokens=False)
    cut = ids[:-1]  # the crab's last byte token never arrives
    assert tokenizer.decode(cut).endswith("\ufffd")
    deltas, rest, _ = stream(tokenizer, [], cut)
    assert "\ufffd" not in "".join(deltas)
    assert "".join(deltas) + rest == tokenizer.decode(cut)
    assert rest.endswith("\ufffd")


def test_leading_spaces_survive(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    text = " world, how  are you"
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, _, _ = stream(tokenizer, prompt, ids)
    assert [d for d in deltas if d][0].startswith(" world")  # the first token keeps its space
    assert "".join(deltas) == text
    assert " you" in deltas  # later tokens keep theirs (▁you / Ġyou)


def test_decodes_only_a_small_window(tokenizer: Tokenizer) -> None:
    lengths: list[int] = []
    recording = Tokenizer.from_hf(tokenizer.hf)
    recording.decode = lambda ids, skip_special_tokens=True: (  # type: ignore[method-assign]
        lengths.append(len(ids)) or tokenizer.decode(ids, skip_special_tokens))
    prompt = tokenizer.encode("a long prompt " * 50, add_special_tokens=False)
    ids = tokenizer.encode(" ".join(TEXTS) * 12, add_special_tokens=False)
    deltas, rest, _ = stream(recording, prompt, ids)
    assert len(ids) > 200
    assert "".join(deltas) + rest == generated_text(tokenizer, prompt, ids)
    assert max(lengths) <= 16  # never the whole sequence (or prompt)
    assert len(lengths) <= 2 * len(ids) + 1


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer: Tokenizer, skip: bool) -> None:
    eos = next(iter(tokenizer.eos_token_ids))
    ids = tokenizer.encode(" one", add_special_tokens=False) + [eos] + tokenizer.encode(
        " two", add_special_tokens=False)
    deltas, rest, _ = stream(tokenizer, [], ids, skip_special_tokens=skip)
    out = "".join(deltas) + rest
    assert out == tokenizer.decode(ids, skip_special_tokens=skip)
    assert (tokenizer.token_str(eos) in out) is not skip


def test_stop_string_across_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(" alpha beta gamma delta", add_special_tokens=False)
    full = tokenizer.decode(ids)
    stop_at = [i for i in range(1, len(ids) + 1) if "a gam" in tokenizer.decode(ids[:i])][0]
    assert "a gam" not in "".join(tokenizer.token_str(i) for i in ids[stop_at - 1:stop_at])
    deltas, rest, detok = stream(tokenizer, [], ids, stop=["a gam"])
    out = "".join(deltas) + rest
    assert len(deltas) == stop_at  # caught on the token that completed it, not later
    assert out == full[: full.index("a gam")] == detok.text
    assert detok.stop_string == "a gam"
    assert "gam" not in "".join(deltas)

    deltas, rest, _ = stream(tokenizer, [], ids, stop=["a gam"], include_stop_str_in_output=True)
    assert "".join(deltas) + rest == full[: full.index("a gam") + len("a gam")]


def test_stop_string_inside_one_token_and_earliest_wins(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    deltas, rest, _ = stream(tokenizer, [], ids, stop=["ell"])
    assert "".join(deltas) + rest == "H"
    deltas, rest, detok = stream(tokenizer, [], ids, stop=["world", "lo w"])
    assert "".join(deltas) + rest == "Hel"
    assert detok.stop_string == "lo w"


def test_multibyte_stop_string(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("go 🦀 ж end", add_special_tokens=False)
    deltas, rest, detok = stream(tokenizer, [], ids, stop=["ж"])
    assert "".join(deltas) + rest == "go 🦀 "
    assert detok.stop_string == "ж"
    assert not any("\ufffd" in d for d in deltas)


def test_hold_back_and_flush_without_match(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(" the cat sat on the mat", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["zzzzzz"])
    emitted = ""
    for token_id in ids:
        emitted += detok.update([token_id]).delta_text
        assert len(emitted) == max(0, len(detok.text) - 5)  # the last 5 chars are held
    rest = detok.flush()
    assert rest == detok.text[-5:]
    assert emitted + rest == tokenizer.decode(ids)
    assert detok.flush() == ""


def test_held_back_prefix_of_stop_string_is_released(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("say Hel", add_special_tokens=False)
    deltas, rest, detok = stream(tokenizer, [], ids, stop=["Hello"])
    assert detok.stop_string is None
    assert "".join(deltas) + rest == "say Hel"
    assert "Hel" in rest  # it might have begun "Hello", so it waited for flush


def test_stop_at_the_very_start_and_nothing_after(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["Hel"])
    updates = [detok.update([i]) for i in ids]
    stops = [u.stop_string for u in updates if u.stop_string]
    assert stops == ["Hel"]
    assert detok.finished
    assert "".join(u.delta_text for u in updates) + detok.flush() == "" == detok.text


def test_stop_strings_ignored_before_min_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ab ab ab ab", add_special_tokens=False)
    first_ab = next(i for i in range(1, len(ids)) if "ab" in tokenizer.decode(ids[:i]))
    deltas, rest, detok = stream(tokenizer, [], ids, stop=["ab"], min_tokens=first_ab + 1,
                                 include_stop_str_in_output=True)
    out = "".join(deltas) + rest
    assert detok.stop_string == "ab"
    assert out.endswith("ab")
    assert len(out) > 2
