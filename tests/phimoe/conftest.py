"""Oracle checkpoints of PhiMoE (``phimoe``), one per layout, built once per session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engine_support import OracleCheckpoints


class _Checkpoints(OracleCheckpoints):
    def get(self, layout: str = "per_expert") -> tuple[Path, Any]:  # type: ignore[override]
        return super().get(layout)


@pytest.fixture(scope="session")
def phimoe_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> _Checkpoints:
    return _Checkpoints("oracle_phimoe", tmp_path_factory)
