"""What ``hpu-serve serve`` logs and how: the line format, request logs, the stats line.

vLLM's flag names: ``--enable-log-requests`` (its older ``--disable-log-requests`` names the
default here and is accepted as such), ``--max-log-len``, ``--disable-log-stats``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from server.config.fields import flag, knob

LOGGING = "logging"


class LogFormat(str, enum.Enum):
    """How each log line is written (``--log-format``)."""

    TEXT = "text"  # "INFO 05-12 10:00:00 server.cli: ..." for people
    JSON = "json"  # one JSON object per line for log pipelines (Loki, ELK...)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class LoggingConfig:
    """Logging settings of the server process (its worker processes log the same way)."""

    log_format: LogFormat = flag(
        LogFormat.TEXT, group=LOGGING,
        help="text, or json: one JSON object per line (timestamp, level, logger, message, "
             "request_id...) from every logger of the process and its workers")
    enable_log_requests: bool = flag(
        False, group=LOGGING, exclusive="log-requests",
        help="log each request's id, sizes, sampling parameters and outcome (never its "
             "text unless --log-prompts)")
    disable_log_requests: bool = flag(
        False, group=LOGGING, exclusive="log-requests",
        help="vLLM's older flag: no request logs, which is the default here")
    log_prompts: bool = flag(
        False, group=LOGGING,
        help="with --enable-log-requests: also log prompts and generated texts (personal "
             "data: keep off in production)")
    max_log_len: int | None = flag(
        None, group=LOGGING,
        help="with --log-prompts: characters of each prompt and output logged "
             "(None: all of it)")
    disable_log_stats: bool = flag(
        False, group=LOGGING,
        help="no periodic stats line (throughput, running and waiting requests, KV cache, "
             "prefix cache hits, compilations, bucket misses)")
    log_stats_interval: float = knob(
        10.0, env="VLLM_LOG_STATS_INTERVAL",
        help="seconds between two stats lines (one is written only when something ran or "
             "changed)")

    def __post_init__(self) -> None:
        if self.log_prompts and not self.enable_log_requests:
            raise ValueError("--log-prompts needs --enable-log-requests")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError("--max-log-len must be >= 0")
        if self.log_stats_interval <= 0:
            raise ValueError("VLLM_LOG_STATS_INTERVAL must be > 0")

    @property
    def stats_interval(self) -> float | None:
        """Seconds between stats lines; None when they are off."""
        return None if self.disable_log_stats else self.log_stats_interval
