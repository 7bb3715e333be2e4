"""The HTTP side of ``hpu-serve serve``: address, key, request limits, connections, fairness."""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

from server.config.fields import env_value, fixed, flag, option, section
from server.config.logging import LOGGING, LoggingConfig
from server.config.responses import RESPONSES, ResponsesStoreConfig
from server.config.tracing import TRACING, TracingConfig

MiB = 1 << 20
# --api-key's variable, which clients of this server (buckets --suggest) read too
API_KEY_ENV = "VLLM_API_KEY"

LIMITS = "request limits (beyond them: 400 naming the field)"
FAIRNESS = "fairness between clients"
CHAT = "tool calls and reasoning"
CONNECTIONS = "connections"
TLS = "TLS (HTTPS)"


class FairShare(str, enum.Enum):
    """Who counts as one client for fair admission and per-client limits (``--fair-share``)."""

    OFF = "off"  # first come, first served (per-client limits then key by address)
    API_KEY = "api-key"  # the bearer key of the request
    ADDRESS = "address"  # the peer's IP address

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What one API request may ask for; beyond it the answer is 400 naming the field.

    ``max_logprobs`` is vLLM's flag; the others have no vLLM counterpart. OpenAI's own
    ranges (top_logprobs <= 20, completions logprobs <= 5, n <= 128...) always apply.
    """

    max_logprobs: int = flag(20, help="top logprobs per token (chat top_logprobs, completions "
                                      "logprobs; OpenAI's own caps of 20 and 5 apply too)")
    max_stop_strings: int = flag(4, help="stop strings per request (OpenAI allows 4)")
    max_stop_token_ids: int = flag(1024, help="stop_token_ids per request")
    max_logit_bias: int = flag(1024, help="logit_bias entries per request")
    max_messages: int = flag(1024, help="chat messages per request")
    max_prompts: int = flag(128, help="prompts in one completions request")
    max_tokens_per_request: int = flag(
        131072, help="prompts x n x max_tokens of one request (an unset max_tokens counts as "
                     "the context length)")
    max_seqs_per_request: int = flag(
        256, help="prompts x n of one request (the sequences it adds to the batch)")

    def __post_init__(self) -> None:
        for f in fields(self):
            least = 0 if f.name == "max_logprobs" else 1  # 0 logprobs: none may be asked
            if getattr(self, f.name) < least:
                raise ValueError(f"{option(type(self), f.name)} must be >= {least}")


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """How chat answers are read back: tool calls and reasoning (vLLM's flag names)."""

    enable_auto_tool_choice: bool = flag(
        False, help="let the model decide to call tools (tool_choice auto); needs "
                    "--tool-call-parser")
    tool_call_parser: str | None = flag(
        None, help="how the model writes tool calls: hermes, llama3_json, mistral, pythonic, "
                   "openai (gpt-oss's harmony)")
    reasoning_parser: str | None = flag(
        None, help="split reasoning_content from content: deepseek_r1, qwen3, openai_gptoss "
                   "(gpt-oss's harmony channels)")

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """HTTP-side settings of ``hpu-serve serve``."""

    host: str = flag("0.0.0.0", help="address to listen on")
    port: int = flag(8000, help="port to listen on")
    enable_prompt_tokens_details: bool = flag(
        False, help="usage reports prompt_tokens_details.cached_tokens: the prompt tokens "
                    "served from the prefix cache")
    enable_tokenizer_info_endpoint: bool = flag(
        False, help="serve GET /tokenizer_info: the tokenizer's settings, class and chat "
                    "template (off: 404, as in vLLM, since it discloses the chat template)")
    root_path: str = flag(
        "", help="the path prefix a proxy serves this server under (/llm): routes answer with "
                 "and without it, and the API key guards both")
    enable_server_load_tracking: bool = flag(
        False, help="GET /load answers {\"server_load\": N}, the requests generating or "
                    "pooling right now (0 without this flag)")
    api_server_count: int = flag(
        1, aliases=("-asc",),
        help="API server processes; one here: the engine runs in the API server's process "
             "and no second process can share it (run replicas behind a load balancer)")
    api_key: str | None = flag(None, env=API_KEY_ENV,
                               help="protects /v1/*, /reset_prefix_cache and /buckets/observed")
    max_waiting_requests: int = flag(
        1024, help="answer 503 with Retry-After once this many requests wait (0: unbounded)")
    max_body_bytes: int = flag(16 * MiB, name="max-request-body-bytes",
                               help="larger bodies (declared or chunked) are answered 413")
    shutdown_timeout: float = flag(30.0,
                                   help="seconds in-flight requests get to finish after SIGTERM")
    allowed_origins: tuple[str, ...] = flag(("*",), help="CORS: allowed origins")
    allowed_methods: tuple[str, ...] = flag(("*",), help="CORS: allowed methods")
    allowed_headers: tuple[str, ...] = flag(("*",), help="CORS: allowed headers")
    allow_credentials: bool = flag(False, help="CORS: allow credentials")
    log_level: str = flag("info", name="uvicorn-log-level",
                          choices=("debug", "info", "warning", "error", "critical"),
                          help="log level of the HTTP server")
    disable_access_log: bool = flag(False, name="disable-uvicorn-access-log",
                                    help="no log line per request")
    ssl_keyfile: str | None = flag(None, group=TLS,
                                   help="private key (PEM) of the server's certificate")
    ssl_certfile: str | None = flag(
        None, group=TLS, help="certificate (PEM) the server presents: HTTPS on --port")
    ssl_ca_certs: str | None = flag(
        None, group=TLS, help="CA certificates (PEM) that client certificates are checked "
                              "against")
    ssl_cert_reqs: int = flag(
        0, group=TLS, help="client certificates: 0 not asked, 1 checked when sent, 2 "
                           "required (Python's ssl.CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED)")
    limits: RequestLimits = section(RequestLimits, group=LIMITS)
    chat: ChatOptions = section(ChatOptions, group=CHAT)
    logging: LoggingConfig = section(LoggingConfig, group=LOGGING)
    tracing: TracingConfig = section(TracingConfig, group=TRACING)
    responses: ResponsesStoreConfig = section(ResponsesStoreConfig, group=RESPONSES)
    # Connections (uvicorn's names where it has them)
    timeout_keep_alive: float = flag(5.0, group=CONNECTIONS,
                                     help="seconds an idle keep-alive connection stays open")
    timeout_request_header: float = flag(
        20.0, group=CONNECTIONS, help="seconds a client has to send a request's headers (from "
                                      "the request's first byte); then 408 and close")
    timeout_request_body: float = flag(
        30.0, group=CONNECTIONS, help="longest pause, in seconds, while a request body is "
                                      "received; then 408 and close")
    limit_concurrency: int = flag(
        512, group=CONNECTIONS, help="requests served at once; one more is answered 503 (0: "
                                     "unbounded; /health is always served; idle connections "
                                     "do not count)")
    timeout_idle_connection: float = flag(
        5.0, group=CONNECTIONS,
        help="seconds a new connection may stay silent before it is closed")
    max_idle_connections_per_address: int = flag(
        64, group=CONNECTIONS, help="silent connections one address may hold; more are closed")
    fair_share: FairShare = flag(
        FairShare.ADDRESS, group=FAIRNESS,
        help="who one client is: admission round-robins over clients' waiting requests, and a "
             "client over its share of the batch is preempted first when another waits (off: "
             "first come, first served)")
    max_client_seqs: int = flag(
        0, group=FAIRNESS, help="sequences one client (--fair-share's key; the address when "
                                "off) may have waiting or running; beyond: 429 with "
                                "Retry-After (0: unbounded)")
    preprocess_workers: int = flag(
        4, group=FAIRNESS, help="threads that tokenize, render templates and serialize big "
                                "answers off the event loop (one client gets at most half)")
    health_stall_timeout: float = flag(
        120.0, group=FAIRNESS, help="/health answers 503 once the engine has had work but "
                                    "finished no step for this many seconds")
    max_request_id_length: int = fixed(256, help="X-Request-Id longer than this: 400")

    def __post_init__(self) -> None:
        cls = type(self)
        for name in ("timeout_keep_alive", "timeout_request_header", "timeout_request_body"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{option(cls, name)} must be > 0")
        if self.limit_concurrency < 0:
            raise ValueError("--limit-concurrency must be >= 0 (0: unbounded)")
        for name in ("timeout_idle_connection", "health_stall_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{option(cls, name)} must be > 0")
        for name in ("max_idle_connections_per_address", "preprocess_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{option(cls, name)} must be >= 1")
        if self.api_server_count != 1:
            raise ValueError(
                f"--api-server-count {self.api_server_count}: one API server process serves "
                "here. The engine (model, KV cache, warmed-up graphs) lives in that process "
                "and no other process can share it; scale out with replicas behind a load "
                "balancer instead")
        self._check_tls()
        if self.max_client_seqs < 0 or self.max_waiting_requests < 0:
            raise ValueError("--max-client-seqs and --max-waiting-requests must be >= 0 "
                             "(0: unbounded)")


    def _check_tls(self) -> None:
        """A TLS setting that cannot work stops start-up naming it, before the model loads."""
        if self.ssl_cert_reqs not in (0, 1, 2):
            raise ValueError(f"--ssl-cert-reqs must be 0, 1 or 2, got {self.ssl_cert_reqs}")
        if self.ssl_keyfile and not self.ssl_certfile:
            raise ValueError("--ssl-keyfile needs --ssl-certfile")
        if self.ssl_cert_reqs and not self.ssl_certfile:
            raise ValueError("--ssl-cert-reqs needs --ssl-certfile (and --ssl-ca-certs)")
        if self.ssl_cert_reqs and not self.ssl_ca_certs:
            raise ValueError("--ssl-cert-reqs needs --ssl-ca-certs: the CAs that client "
                             "certificates are checked against")
        for name in ("ssl_certfile", "ssl_keyfile", "ssl_ca_certs"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise ValueError(f"{option(type(self), name)} {path}: no such file")

    @property
    def tls(self) -> bool:
        return self.ssl_certfile is not None


def api_key_from_env(given: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """``--api-key`` if given, else ``VLLM_API_KEY`` (the server's rule, for clients too)."""
    return given or env_value(ServerConfig, "api_key", environ) or None
