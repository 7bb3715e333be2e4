"""Property-based tests (hypothesis) of incremental detokenization and stop strings.

The invariant: whatever the text (any Unicode, characters split over byte tokens), however
the tokens arrive (one at a time or several per step), the concatenated deltas plus
``flush()`` equal the full decode of the generated tokens, cut at the first stop string.
Run on the tiny byte-level tokenizer of tests/conftest.py, a sentencepiece-style one with
byte-fallback tokens (``<0xE2>``), and the embedded SmolLM2 tokenizer.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from test_detokenizer import metaspace_tokenizer

from server.engine.detokenizer import IncrementalDetokenizer
from server.engine.tokenizer import Tokenizer

SETTINGS = settings(max_examples=200, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])
# Text the tokenizers know well, mixed with characters they split into byte tokens.
WORDS = ["the", " quick", " fox", "\n", " ", "héllo", " wörld", "日本語", "テキスト", "🙂",
         "🚀", "𝄞", "ж", "∮", "e\u0301", "\u200d", "\x00", "\t", "ab", "ba", "aa"]
TEXT = st.one_of(
    st.lists(st.sampled_from(WORDS), max_size=12).map("".join),
    st.text(st.characters(codec="utf-8"), max_size=24),  # any code point but surrogates
)


@pytest.fixture(scope="module", params=["tiny-byte-level", "byte-fallback", "smollm2"])
def tokenizer(request, tiny_model) -> Tokenizer:
    if request.param == "tiny-byte-level":  # tests/conftest.py's, as the tiny models use
        return Tokenizer.from_hf(tiny_model[2])
    if request.param == "byte-fallback":
        return metaspace_tokenizer()
    return request.getfixturevalue("smollm2_tokenizer")


def run(tok: Tokenizer, prompt: list[int], ids: list[int], chunks: list[int],
        **kw: object) -> tuple[str, IncrementalDetokenizer]:
    """Feeds ``ids`` in chunks of the given sizes (cycled) until a stop string matches;
    returns everything emitted (deltas + flush)."""
    detok = IncrementalDetokenizer(tok, prompt, **kw)  # type: ignore[arg-type]
    out, i, step = [], 0, 0
    while i < len(ids):
        size = chunks[step % len(chunks)]
        update = detok.update(ids[i:i + size])
        out.append(update.delta_text)
        i, step = i + size, step + 1
        if update.stop_string is not None:
            break
    out.append(detok.flush())
    return "".join(out), detok


def full_decode(tok: Tokenizer, prompt: list[int], ids: list[int]) -> str:
    """The reference: what decoding prompt + generated adds after the prompt's text.

    Only for tokens that form valid UTF-8: where they do not, a full decode's U+FFFD
    depend on the bytes' neighbours (see ``test_invalid_utf8_may_decode_differently``)."""
    text = tok.decode(prompt + ids)[len(tok.decode(prompt)):]
    assume("\ufffd" not in text)
    return text


@st.composite
def generation(draw: st.DrawFn, tok: Tokenizer) -> tuple[list[int], list[int], list[int]]:
    prompt = tok.encode(draw(st.sampled_from(["", "Say:", "日本", "a b c"])),
                        add_special_tokens=False)
    if draw(st.booleans()):
        ids = tok.encode(draw(TEXT), add_special_tokens=False)
    else:  # any token sequence, valid UTF-8 or not (a model may emit one)
        ids = draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=24))
    chunks = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    return prompt, ids, chunks


def boundaries(tok: Tokenizer, prompt: list[int], ids: list[int]) -> list[int]:
    """Offsets in the generated text where one token's text ends and the next one's begins."""
    base = len(tok.decode(prompt))
    return sorted({len(tok.decode(prompt + ids[:k])) - base for k in range(1, len(ids))})


def stops_in(draw: st.DrawFn, text: str, cuts: list[int]) -> list[str]:
    """1-3 stop strings: most taken from the text, so they occur, many of them across a
    token boundary (the case held-back text exists for); some that may never occur."""
    stops = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["across", "inside", "random"])) if text else "random"
        inner = [c for c in cuts if 0 < c < len(text)]
        if kind == "across" and inner:
            cut = draw(st.sampled_from(inner))
            start = draw(st.integers(max(0, cut - 4), cut - 1))
            stops.append(text[start:draw(st.integers(cut + 1, min(len(text), cut + 4)))])
        elif kind != "random":
            start = draw(st.integers(0, len(text) - 1))
            stops.append(text[start:start + draw(st.integers(1, 6))])
        else:
            stops.append(draw(st.text(st.characters(codec="utf-8"), min_size=1, max_size=4)))
    return stops


@SETTINGS
@given(data=st.data())
def test_deltas_and_flush_equal_the_full_decode(tokenizer: Tokenizer, data: st.DataObject
                                                ) -> None:
    prompt, ids, chunks = data.draw(generation(tokenizer))
    out, detok = run(tokenizer, prompt, ids, chunks)
    assert out == full_decode(tokenizer, prompt, ids) == detok.text
    if any("\ufffd" in tokenizer.token_str(i) for i in ids):
        event("a character split over byte tokens")


@SETTINGS
@given(data=st.data(), include=st.booleans())
def test_one_stop_string_cuts_at_its_first_occurrence(tokenizer: Tokenizer,
                                                      data: st.DataObject,
                                                      include: bool) -> None:
    prompt, ids, chunks = data.draw(generation(tokenizer))
    full = full_decode(tokenizer, prompt, ids)
    stop = stops_in(data.draw, full, boundaries(tokenizer, prompt, ids))[0]
    out, detok = run(tokenizer, prompt, ids, chunks, stop=[stop],
                     include_stop_str_in_output=include)
    at = full.find(stop)
    cuts = boundaries(tokenizer, prompt, ids)
    event("stop absent" if at == -1 else "stop across tokens"
          if any(at < c < at + len(stop) for c in cuts) else "stop within a token")
    if at == -1:
        assert out == full and detok.stop_string is None
    else:
        assert out == full[:at + len(stop) if include else at]
        assert detok.stop_string == stop


@SETTINGS
@given(data=st.data())
def test_several_stop_strings(tokenizer: Tokenizer, data: st.DataObject) -> None:
    """With several stops the output is cut just before one of them and holds none: which
    one, when two overlap, depends on how much text one step brings (see docs/serving.md)."""
    prompt, ids, chunks = data.draw(generation(tokenizer))
    full = full_decode(tokenizer, prompt, ids)
    stops = stops_in(data.draw, full, boundaries(tokenizer, prompt, ids))
    out, detok = run(tokenizer, prompt, ids, chunks, stop=stops)
    assert full.startswith(out)
    assert not any(s in out for s in stops)
    if any(s in full for s in stops):
        assert detok.stop_string in stops and full[len(out):].startswith(detok.stop_string)
        # nothing was cut early: every stop in the output's reach starts at or after the cut
        first_end = min(full.find(s) + len(s) for s in stops if s in full)
        assert len(out) < first_end
    else:
        assert out == full and detok.stop_string is None


@pytest.mark.xfail(strict=True, reason="known: a byte-fallback decoder turns a whole run of "
                   "byte tokens into U+FFFD when the run is invalid UTF-8, so a byte that was "
                   "valid text alone (emitted at once) decodes differently in the full text")
def test_invalid_utf8_may_decode_differently() -> None:
    tok = metaspace_tokenizer()
    ids = tok.hf.convert_tokens_to_ids(["<0x00>", "<0x80>"])  # NUL, then a stray byte
    out, _ = run(tok, [], ids, [1])
    assert out == tok.decode(ids)  # streamed "\x00\ufffd", full decode "\ufffd\ufffd"
