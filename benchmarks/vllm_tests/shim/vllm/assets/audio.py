"""vLLM's audio assets: named only (audio input is not applicable to hpu-serve)."""


class AudioAsset:
    def __init__(self, name: str) -> None:
        self.name = name

    @property
    def url(self) -> str:  # read when vLLM's test module is imported; never fetched
        return f"https://unavailable.invalid/{self.name}.ogg"
