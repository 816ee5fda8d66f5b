"""The oracle checkpoint of Mistral Small 4 (``mistral4``), built once per session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engine_support import OracleCheckpoints


class _Checkpoints(OracleCheckpoints):
    def get(self) -> tuple[Path, Any]:  # type: ignore[override]
        return super().get()


@pytest.fixture(scope="session")
def mistral4_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> _Checkpoints:
    return _Checkpoints("oracle_mistral4", tmp_path_factory)
