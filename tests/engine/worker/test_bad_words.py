"""bad_words' rule (vLLM's NoBadWordsLogitsProcessor): a one-token word always banned, a
longer word's last token banned only right after the rest of it was generated."""

from __future__ import annotations

from server.engine.worker.sampler import banned_by_bad_words


def test_single_token_words_are_always_banned() -> None:
    assert banned_by_bad_words([[7]], []) == [7]
    assert banned_by_bad_words([[7]], [1, 2, 3]) == [7]


def test_multi_token_words_ban_their_last_token_after_their_prefix() -> None:
    word = [[4, 5, 6]]
    assert banned_by_bad_words(word, []) == []  # too few generated tokens
    assert banned_by_bad_words(word, [4]) == []
    assert banned_by_bad_words(word, [1, 4, 5]) == [6]
    assert banned_by_bad_words(word, [4, 5, 1]) == []
    assert banned_by_bad_words([[4, 5], [9], [5, 6]], [3, 4]) == [5, 9]
