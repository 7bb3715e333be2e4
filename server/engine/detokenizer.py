"""Incremental detokenization and stop-string matching, per sequence."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

from server.engine.tokenizer import Tokenizer

# Prompt tokens kept as decoding context, so the first generated token's leading space
# (byte-level "Ġ", sentencepiece "▁") comes out as it would in the full text.
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"  # what decoding writes for bytes of a not-yet-complete character


@dataclass(slots=True)
class DetokenizerUpdate:
    """What one ``update`` produced."""

    delta_text: str  # text safe to emit now
    stop_string: str | None = None  # the stop string that ended the sequence, if any


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, and finds stop strings.

    Decoding (vLLM's prefix/read offsets): only the window ``ids[prefix_offset:]`` is decoded
    each step, and what it adds over ``ids[prefix_offset:read_offset]`` (text already out) is
    the new text. The window starts on a few prompt tokens so that leading spaces come out as
    in the full text, and slides forward once new text is out, so each step costs a few tokens
    whatever the sequence length. A window ending in U+FFFD ends in an incomplete UTF-8
    character: nothing is produced until a later token completes it (or ``flush``).

    Stop strings are searched in the new text plus ``max_stop_len - 1`` characters back, so a
    stop string split over several tokens is caught. The text is then cut just before it
    (just after with ``include_stop_str_in_output``). While stop strings are configured, the
    last ``max_stop_len - 1`` characters are held back from ``delta_text``: they might begin a
    stop string. They come out in later updates or in ``flush``. All ``delta_text`` plus
    ``flush()`` always equals ``text``.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Seq[int],
        *,
        skip_special_tokens: bool = True,
        stop: Seq[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in stop if s]
        self.include_stop = include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.min_tokens = min_tokens  # stop strings are ignored before this many tokens
        self.num_tokens = 0  # generated tokens seen
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None  # decode of ids[prefix_offset:read_offset]
        self.text = ""  # all decoded text so far (cut at a matched stop string)
        self._emitted = 0  # characters of `text` already handed out
        self.stop_string: str | None = None  # set once a stop string matched

    @property
    def finished(self) -> bool:
        """True once a stop string matched; later updates produce nothing."""
        return self.stop_string is not None

    def update(self, new_token_ids: Seq[int]) -> DetokenizerUpdate:
        """Adds generated tokens; returns the text safe to emit and any stop string hit."""
        if self.stop_string is not None:
            return DetokenizerUpdate("")
        self._ids.extend(new_token_ids)
        self.num_tokens += len(new_token_ids)
        added = self._decode_window(final=False)
        stop_string = self._add_text(added)
        if stop_string is not None or not self.stop:
            emit_upto = len(self.text)
        else:
            emit_upto = max(self._emitted, len(self.text) - (self.max_stop_len - 1))
        delta = self.text[self._emitted : emit_upto]
        self._emitted = emit_upto
        return DetokenizerUpdate(delta, stop_string)

    def flush(self) -> str:
        """On finish: all text still held back (an unfinished character comes out as U+FFFD).

        If the final text completes a stop string, the text is cut there as in ``update`` and
        ``stop_string`` is set; a matched stop string is never returned (unless included).
        """
        if self.stop_string is None:
            self._add_text(self._decode_window(final=True))
        rest = self.text[self._emitted :]
        self._emitted = len(self.text)
        return rest

    def _add_text(self, added: str) -> str | None:
        if not added:
            return None
        self.text += added
        if not self.stop or self.num_tokens < self.min_tokens:
            return None
        return self._find_stop(len(added))

    def _decode_window(self, final: bool) -> str:
        ids = self._ids
        if self._read_offset >= len(ids):
            return ""
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        prefix = self._prefix_text
        if prefix is None:
            prefix = decode(ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip)
            self._prefix_text = prefix
        full = decode(ids[self._prefix_offset :], skip_special_tokens=skip)
        if len(full) <= len(prefix) or (full.endswith(_REPLACEMENT) and not final):
            return ""  # nothing new yet (skipped special token, or unfinished character)
        # Slide the window: the new tokens become the next prefix; older ids are dropped.
        del ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(ids)
        self._prefix_text = None
        return full[len(prefix) :]

    def _find_stop(self, num_new_chars: int) -> str | None:
        # Only the new text plus a stop string's length back can hold a new match.
        start = max(0, len(self.text) - num_new_chars - self.max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self.stop:
            idx = self.text.find(stop, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        self.text = self.text[: idx + len(stop)] if self.include_stop else self.text[:idx]
        # Held-back text starts at or before any new match, so nothing emitted is cut.
        self._emitted = min(self._emitted, len(self.text))
        self.stop_string = stop
        return stop
