"""``hpu-serve run-batch``'s own options (vLLM's ``vllm run-batch``): an OpenAI batch file in,
one answer line per request out. The engine and server flags are serve's."""

from __future__ import annotations

from dataclasses import dataclass

from server.config.fields import flag


@dataclass(frozen=True, slots=True)
class BatchOptions:
    """One batch run: where the requests come from, where the answers go."""

    input_file: str | None = flag(
        None, aliases=("-i",), group="run-batch",
        help="the OpenAI batch file: one JSON request a line (custom_id, method, url, body); "
             "- reads standard input")
    output_file: str | None = flag(
        None, aliases=("-o",), group="run-batch",
        help="where the answers go, one JSON line per request in the input's order (id, "
             "custom_id, response, error); - writes standard output")
    enable_metrics: bool = flag(
        False, group="run-batch",
        help="serve Prometheus /metrics on --host / --port while the batch runs")

    def validate(self) -> None:
        for name, value in (("--input-file/-i", self.input_file),
                            ("--output-file/-o", self.output_file)):
            if not value:
                raise ValueError(f"run-batch needs {name}")
            if value.startswith(("http://", "https://")):
                raise ValueError(f"{name} {value}: batch files are read and written on local "
                                 "disk here (no URLs); download or upload it around the run")
