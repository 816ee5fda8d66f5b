"""Oracle checkpoints of Kimi Linear (``kimi_linear``), one per layout, built once per session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engine_support import OracleCheckpoints


class _Checkpoints(OracleCheckpoints):
    def get(self, layout: str = "per_expert") -> tuple[Path, Any]:  # type: ignore[override]
        return super().get(layout)


@pytest.fixture(scope="session")
def kimi_linear_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> _Checkpoints:
    return _Checkpoints("oracle_kimi_linear", tmp_path_factory)
