"""A model named by its Hugging Face Hub id (``org/name``, or ``org/name:Q4_K_M`` for one
GGUF quantization of a repository holding several), turned into a local folder or file
through huggingface_hub's cache, as ``vllm serve org/name`` does.

The cache is huggingface_hub's own (``--download-dir``, else HF_HUB_CACHE or HF_HOME/hub):
what is there loads without the network. ``HF_HUB_OFFLINE=1`` never contacts the Hub;
otherwise the Hub is asked which commit the revision names (and the files are fetched when
missing), and an unreachable Hub falls back to the cache. The Hub's HTTP client gets a
connect timeout, so that a network that drops packets fails in seconds rather than after
the operating system's minutes.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from server.config import EngineConfig
from server.config.model import HubOptions
from server.models.errors import MissingModelFileError

logger = logging.getLogger(__name__)

HUB_CONNECT_TIMEOUT_S = 5.0
HUB_READ_TIMEOUT_S = 60.0  # between two reads of a download, not for the whole file
# what a model folder needs; other files (.bin and .pth copies of the weights, ONNX
# exports, images) are never read here
WANTED = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken"]
_HUB_ID = re.compile(r"^(?:[\w.-]+/)?[\w.-]+(?::(?P<quant>[\w.-]+))?$")


@dataclass(frozen=True, slots=True)
class HubModel:
    """Where a Hub id's files are on this machine."""

    repo_id: str
    path: str  # the snapshot folder, or the GGUF file a :QUANT suffix picked
    served_name: str  # the id as given, as vLLM serves it


def is_local(model: str) -> bool:
    return Path(model).expanduser().exists()


def hub_id_of(model: str) -> tuple[str, str | None] | None:
    """(repository id, GGUF quantization or None) when ``model`` reads as a Hub id."""
    match = _HUB_ID.match(model)
    # a path spelled as one (./x, ~/x, /x, x.gguf) is never an id, even when nothing is there
    if match is None or model.endswith(".gguf") or model.startswith((".", "~", "/")):
        return None
    quant = match.group("quant")
    return (model[: -len(quant) - 1] if quant else model), quant


def resolve_hub_model(model: str, hub: HubOptions) -> HubModel:
    """The local copy of Hub model ``model`` (in the cache, or fetched into it); a
    MissingModelFileError saying why not, in one line."""
    ids = hub_id_of(model)
    if ids is None:
        raise MissingModelFileError(f"model {model!r}: no such local file or folder (and no "
                                    "Hub id: org/name or org/name:QUANT)")
    repo_id, quant = ids
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    _bound_timeouts(huggingface_hub)
    patterns = [f"*{quant}*.gguf", f"*{quant.lower()}*.gguf"] if quant else WANTED
    try:
        folder = huggingface_hub.snapshot_download(
            repo_id, revision=hub.revision, cache_dir=hub.download_dir,
            local_files_only=hub.offline, allow_patterns=patterns)
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as exc:
        where = hub.download_dir or huggingface_hub.constants.HF_HUB_CACHE
        how = ("HF_HUB_OFFLINE is set" if hub.offline
               else f"the Hub did not give it: {_first_line(exc)}")
        raise MissingModelFileError(
            f"model {model!r} is no local path and revision {hub.revision or 'main'} of "
            f"Hub model {repo_id} is not in the cache {where} ({how})") from None
    path = folder
    if quant:
        found = sorted(p for p in Path(folder).rglob("*.gguf") if quant.lower() in p.name.lower())
        if not found:
            raise MissingModelFileError(f"Hub model {repo_id} has no .gguf file of "
                                        f"quantization {quant}")
        path = str(found[0])  # a split GGUF's first part names the rest
    logger.info("Hub model %s (revision %s) from %s", model, hub.revision or "main", path)
    return HubModel(repo_id, path, model)


def with_local_model(config: EngineConfig) -> EngineConfig:
    """``config`` with its model a local path: a Hub id is resolved once here (rank 0,
    before any worker starts), so that every later reader loads the same files and the
    served name stays the id, as in vLLM."""
    model = config.model.model
    if model is None or is_local(model):
        return config
    found = resolve_hub_model(model, config.model.hub)
    options = dataclasses.replace(
        config.model, model=found.path,
        served_model_name=config.model.served_model_name or found.served_name)
    return dataclasses.replace(config, model=options)


def _bound_timeouts(huggingface_hub: object) -> None:
    """The Hub client's timeouts: none by default, so a silent network would hang the
    metadata request until the operating system gives up."""
    session = huggingface_hub.get_session()  # type: ignore[attr-defined]
    session.timeout = type(session.timeout)(HUB_READ_TIMEOUT_S, connect=HUB_CONNECT_TIMEOUT_S)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
