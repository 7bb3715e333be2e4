"""A causal LM read as a classifier through its next-token logits (vLLM's
``classifier_from_token``): Qwen3-Reranker answers "yes" or "no", bge-reranker-v2-gemma "Yes".

The LM head's rows of those tokens become the ``score`` head, so one pass gives the class
logits without computing the whole vocabulary's: ``from_2_way_softmax`` keeps one label,
``logit(yes) - logit(no)`` (its sigmoid is the softmax of the two), ``no_post_processing``
one label per token. The settings are config.json fields, usually given by
``--hf-overrides``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


class TokenHeadMethod(str, enum.Enum):
    """How the tokens' LM-head rows become the score head (vLLM's ``method`` names)."""

    TWO_WAY_SOFTMAX = "from_2_way_softmax"  # one label: row(second) - row(first)
    NO_POST_PROCESSING = "no_post_processing"  # one label per token: its row

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class TokenHead:
    """Which tokens' logits classify, and how."""

    tokens: tuple[str, ...]
    method: TokenHeadMethod

    @property
    def num_labels(self) -> int:
        return 1 if self.method is TokenHeadMethod.TWO_WAY_SOFTMAX else len(self.tokens)

    @classmethod
    def from_hf(cls, hf: Any) -> TokenHead | None:
        """The config's token head (None: the checkpoint's own head, if any).
        ``is_original_qwen3_reranker`` means ``from_2_way_softmax``, as vLLM reads it."""
        tokens = getattr(hf, "classifier_from_token", None)
        method = getattr(hf, "method", None)
        if getattr(hf, "is_original_qwen3_reranker", False):
            method = TokenHeadMethod.TWO_WAY_SOFTMAX.value
        if tokens is None and method is None:
            return None
        if not isinstance(tokens, (list, tuple)) or not tokens \
                or not all(isinstance(t, str) for t in tokens):
            raise ValueError("classifier_from_token must be a list of tokens (e.g. [\"no\", "
                             "\"yes\"]) when method or is_original_qwen3_reranker is set")
        if method is None:
            raise ValueError("classifier_from_token needs a method (from_2_way_softmax or "
                             "no_post_processing) or is_original_qwen3_reranker: true")
        try:
            head = cls(tuple(tokens), TokenHeadMethod(method))
        except ValueError:
            raise ValueError(f"method {method!r} is not supported (from_2_way_softmax or "
                             "no_post_processing)") from None
        if head.method is TokenHeadMethod.TWO_WAY_SOFTMAX and len(head.tokens) != 2:
            raise ValueError("from_2_way_softmax needs two classifier_from_token entries "
                             f"(the 'false' token, then the 'true' one), not {len(tokens)}")
        return head

    def score_weight(self, lm_head: torch.Tensor,
                     token_id: Callable[[str], int | None]) -> torch.Tensor:
        """``[num_labels, hidden]`` float32 from the LM head's ``[vocab, hidden]`` rows."""
        ids = []
        for token in self.tokens:
            found = token_id(token)
            if found is None or not 0 <= found < lm_head.shape[0]:
                raise ValueError(f"classifier_from_token {token!r} is not a token of this "
                                 "model's tokenizer")
            ids.append(found)
        rows = lm_head[ids].float()
        if self.method is TokenHeadMethod.TWO_WAY_SOFTMAX:
            return rows[1:2] - rows[0:1]
        return rows
