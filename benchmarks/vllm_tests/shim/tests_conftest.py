"""Stand-in for vLLM's ``tests/conftest.py`` (installed as ``tests/conftest.py`` of the
staging tree), which needs vLLM: the one name the HTTP tests import from it.

``LocalAssetServer`` serves vLLM's test images to multimodal tests; those tests are not
applicable here (known.py), so it serves nothing."""

from __future__ import annotations

import pytest


class LocalAssetServer:
    def url_for(self, name: str) -> str:
        raise NotImplementedError(f"no test assets here ({name}): multimodal tests are not "
                                  "applicable")


@pytest.fixture(scope="session")
def local_asset_server() -> LocalAssetServer:
    return LocalAssetServer()
