"""Pooling models (embeddings, scores, classification): which runner serves the checkpoint.

vLLM's names: ``--runner generate|pooling|auto`` picks the runner, ``--convert`` serves a
generative checkpoint as a pooling model, and the older ``--task`` spelling maps onto both.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

from server.config.fields import flag

POOLING = "pooling models (embeddings, rerank, score, classification)"


class Runner(str, enum.Enum):
    """``--runner``: ``auto`` reads the checkpoint (sentence-transformers folders, encoders
    and ``*ForSequenceClassification`` pool; everything else generates)."""

    AUTO = "auto"
    GENERATE = "generate"
    POOLING = "pooling"

    def __str__(self) -> str:
        return self.value


class Convert(str, enum.Enum):
    """``--convert``: what a pooling runner turns the checkpoint into (``auto``: what the
    checkpoint is; ``embed`` for a causal LM)."""

    AUTO = "auto"
    NONE = "none"
    EMBED = "embed"
    CLASSIFY = "classify"
    REWARD = "reward"

    def __str__(self) -> str:
        return self.value


# vLLM's older --task values and the runner / convert each stands for
_TASKS: dict[str, tuple[Runner, Convert]] = {
    "auto": (Runner.AUTO, Convert.AUTO),
    "generate": (Runner.GENERATE, Convert.AUTO),
    "embed": (Runner.POOLING, Convert.EMBED),
    "embedding": (Runner.POOLING, Convert.EMBED),
    "classify": (Runner.POOLING, Convert.CLASSIFY),
    "score": (Runner.POOLING, Convert.CLASSIFY),
    "reward": (Runner.POOLING, Convert.REWARD),
}


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    """How a checkpoint is served when it pools rather than generates."""

    runner: Runner = flag(Runner.AUTO, group=POOLING,
                          help="generate: text generation; pooling: embeddings, scores and "
                               "classes (/v1/embeddings, /score, /rerank, /classify, "
                               "/pooling); auto: from the checkpoint")
    convert: Convert = flag(
        Convert.AUTO, group=POOLING,
        help="pooling runner: serve the checkpoint as an embedder (last-token pooling of a "
             "causal LM), a classifier or a reward model; auto: as the checkpoint is")
    task: str | None = flag(
        None, group=POOLING, choices=tuple(_TASKS),
        help="vLLM's older spelling: embed = --runner pooling --convert embed, "
             "classify/score = --convert classify, reward = --convert reward")
    hf_overrides: str | None = flag(
        None, group=POOLING,
        help="JSON object of config.json fields set over the checkpoint's (vLLM's "
             "--hf-overrides; pooling runner only), e.g. Qwen3-Reranker scored by its "
             "yes/no token logits: '{\"architectures\": "
             "[\"Qwen3ForSequenceClassification\"], \"classifier_from_token\": [\"no\", "
             "\"yes\"], \"is_original_qwen3_reranker\": true}'")

    @property
    def overrides(self) -> dict[str, Any]:
        """--hf-overrides as a dict (empty when unset)."""
        if not self.hf_overrides:
            return {}
        try:
            value = json.loads(self.hf_overrides)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--hf-overrides is no JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("--hf-overrides must be a JSON object of config.json fields")
        return value

    def __post_init__(self) -> None:
        value: Any = self.hf_overrides
        if value is not None and not isinstance(value, str):
            # the offline API's dict (LLM(hf_overrides={...})): kept as JSON text
            object.__setattr__(self, "hf_overrides", json.dumps(dict(value)))
        _ = self.overrides  # a bad JSON stops start-up here, in one line
        try:
            runner, convert = Runner(self.runner), Convert(self.convert)
        except ValueError:
            raise ValueError("--runner must be auto, generate or pooling; --convert auto, "
                             "none, embed, classify or reward") from None
        if self.task is not None:
            if self.task not in _TASKS:
                raise ValueError(f"--task {self.task}: one of {', '.join(_TASKS)}")
            task_runner, task_convert = _TASKS[self.task]
            if runner is not Runner.AUTO and runner is not task_runner \
                    and task_runner is not Runner.AUTO:
                raise ValueError(f"--task {self.task} contradicts --runner {runner}")
            runner = task_runner if runner is Runner.AUTO else runner
            convert = task_convert if convert is Convert.AUTO else convert
        if runner is Runner.GENERATE and convert not in (Convert.AUTO, Convert.NONE):
            raise ValueError(f"--convert {convert} needs --runner pooling (or auto)")
        if convert not in (Convert.AUTO, Convert.NONE) and runner is Runner.AUTO:
            runner = Runner.POOLING  # vLLM: a conversion implies the pooling runner
        object.__setattr__(self, "runner", runner)
        object.__setattr__(self, "convert", convert)
