"""Incremental detokenization and stop-string matching, per sequence."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

from server.engine.tokenizer import Tokenizer

# Prompt tokens kept as decoding context, so the first generated token's leading space
# (byte-level "Ġ", sentencepiece "▁") comes out as it would in the full text.
_CONTEXT_TOKENS = 5


@dataclass(slots=True)
class DetokenizerUpdate:
    delta_text: str  # text safe to emit now
    stop_string: str | None  # the stop string that ended the sequence, if any


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes only a small window (``prefix_offset:``) each step and emits what the window
    adds over its already-emitted prefix; a window ending in U+FFFD is an incomplete UTF-8
    character, so it waits for the next token. With stop strings configured, the last
    ``max_stop_len - 1`` characters are held back because they might begin a stop string.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Seq[int],
        *,
        skip_special_tokens: bool = True,
        stop: Seq[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop)
        self.include_stop = include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""  # all decoded text so far (cut at a matched stop string)
        self._emitted = 0  # characters of `text` already handed out
        self._stopped = False

    def update(self, new_token_ids: Seq[int]) -> DetokenizerUpdate:
        if self._stopped:
            return DetokenizerUpdate("", None)
        self._ids.extend(new_token_ids)
        added = self._decode_window(final=False)
        self.text += added
        stop_string = self._find_stop(len(added)) if added and self.stop else None
        if stop_string is not None or not self.stop:
            emit_upto = len(self.text)
        else:
            emit_upto = max(self._emitted, len(self.text) - (self.max_stop_len - 1))
        delta = self.text[self._emitted : emit_upto]
        self._emitted = emit_upto
        return DetokenizerUpdate(delta, stop_string)

    def flush(self) -> str:
        """On finish: whatever is still held back (incomplete characters included)."""
        if not self._stopped:
            self.text += self._decode_window(final=True)
        rest = self.text[self._emitted :]
        self._emitted = len(self.text)
        return rest

    def _decode_window(self, final: bool) -> str:
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        prefix = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip)
        full = decode(self._ids[self._prefix_offset :], skip_special_tokens=skip)
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        # Slide the window; drop ids nobody will decode again.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        del self._ids[: self._prefix_offset]
        self._read_offset -= self._prefix_offset
        self._prefix_offset = 0
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
        self._emitted = min(self._emitted, len(self.text))
        self._stopped = True
        return stop
