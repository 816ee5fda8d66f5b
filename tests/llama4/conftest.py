"""Oracle checkpoints of Llama 4 (``llama4_text`` and ``llama4``), built once per session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engine_support import OracleCheckpoints


class _Checkpoints(OracleCheckpoints):
    def get(self, layout: str = "text") -> tuple[Path, Any]:  # type: ignore[override]
        return super().get(layout)


@pytest.fixture(scope="session")
def llama4_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> _Checkpoints:
    return _Checkpoints("oracle_llama4", tmp_path_factory)
