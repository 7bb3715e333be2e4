"""Stand-in for vLLM's ``tests/utils.py`` (installed as ``tests/utils.py`` of the staging tree):
``RemoteOpenAIServer`` starts hpu-serve where vLLM's tests start ``vllm serve``.

The embedded model (SmolLM2-135M-Instruct) answers under the name each test asks for
(``--served-model-name``), but for the few models stand_ins.py builds in their own shape;
every other flag is passed through as the test wrote it, since hpu-serve takes vLLM's flags
(one it does not know stops start-up, naming it)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import openai

HPU_SERVE_ROOT = Path(os.environ["HPU_SERVE_ROOT"])
sys.path.insert(0, str(HPU_SERVE_ROOT / "benchmarks"))

from local_server import start_server, stop_server  # noqa: E402
from stand_ins import folder_for  # noqa: E402


def _split_model(model: str, args: list[str]) -> tuple[str, list[str]]:
    """(served name, the other args): a ``--model`` in the args overrides the positional one."""
    rest: list[str] = []
    it = iter(args)
    for arg in it:
        if arg == "--model":
            model = next(it)
        elif arg.startswith("--model="):
            model = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    return model, rest


# A hub LoRA adapter the tests download (shaped for their 7B or 0.6B model, so it cannot be
# applied to the embedded 135M model): the conftest hands out a path under this prefix instead,
# and the server is started without the LoRA flags that name it.
UNAVAILABLE_LORA = "/unavailable-hub-lora/"
LORA_FLAGS_WITH_VALUE = ("--max-lora-rank", "--max-cpu-loras", "--max-loras")


def _drop_unavailable_lora(args: list[str]) -> list[str]:
    """``args`` less ``--lora-modules`` entries naming an unavailable adapter, and less the
    other LoRA flags when no adapter is left."""
    out: list[str] = []
    it = iter(args)
    for arg in it:
        if arg == "--lora-modules":
            kept = []
            for module in it:
                if module.startswith("--"):
                    args_after = [module]
                    break
                if UNAVAILABLE_LORA not in module:
                    kept.append(module)
            else:
                args_after = []
            if kept:
                out += ["--lora-modules", *kept]
            out += args_after
        else:
            out.append(arg)
    if "--lora-modules" in out:
        return out
    lean: list[str] = []
    it = iter(out)
    for arg in it:
        if arg in LORA_FLAGS_WITH_VALUE:
            next(it)
        elif arg != "--enable-lora":
            lean.append(arg)
    return lean


# The embedded model's context. A test that sizes --max-model-len for its own longer-context
# model (Qwen3's 40k, zephyr's 32k) gets the embedded model's whole context instead, so that
# its server starts; a request that really needs more then fails, and known.py says why.
EMBEDDED_CONTEXT = 8192


def _cap_context(args: list[str]) -> list[str]:
    out = list(args)
    for i, arg in enumerate(out):
        name, sep, value = arg.partition("=")
        if name.replace("_", "-") != "--max-model-len":
            continue
        if sep and int(value) > EMBEDDED_CONTEXT:
            out[i] = f"{name}={EMBEDDED_CONTEXT}"
        elif not sep and i + 1 < len(out) and int(out[i + 1]) > EMBEDDED_CONTEXT:
            out[i + 1] = str(EMBEDDED_CONTEXT)
    return out


class RemoteOpenAIServer:
    DUMMY_API_KEY = "token-abc123"  # vLLM's tests send this when the server has no key

    def __init__(self, model: str, vllm_serve_args: list[str], *,
                 env_dict: dict[str, str] | None = None, seed: int | None = 0,
                 auto_port: bool = True, max_wait_seconds: float | None = None,
                 override_hf_configs: dict[str, Any] | None = None) -> None:
        if override_hf_configs:
            raise NotImplementedError("override_hf_configs: the embedded model has no HF config")
        self.model, args = _split_model(model, _drop_unavailable_lora(list(vllm_serve_args)))
        stand_in = folder_for(self.model)
        if stand_in is None:  # the embedded model, whose context may be shorter
            args = _cap_context(args)
        self.show_hidden_metrics = any(a.startswith("--show-hidden-metrics-for-version")
                                       for a in args)
        if seed is not None and "--seed" not in args:
            args += ["--seed", str(seed)]
        flags = ["--served-model-name", self.model, *args]
        env = dict(os.environ, **(env_dict or {}))
        self.proc, url, self.log = start_server(stand_in, flags, timeout_s=max_wait_seconds or 600,
                                                env=env)
        self.host, port = url.removeprefix("http://").split(":")
        self.port = int(port)

    def __enter__(self) -> RemoteOpenAIServer:
        return self

    def __exit__(self, *exc: object) -> None:
        stop_server(self.proc)

    @property
    def url_root(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url_for(self, *parts: str) -> str:
        return self.url_root + "/" + "/".join(parts)

    def get_client(self, **kwargs: Any) -> openai.OpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY,
                             max_retries=0, **kwargs)

    def get_async_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY,
                                  max_retries=0, **kwargs)
