"""Oracle checkpoints of MiniMax M2, MiniMax M3 and Kimi K2.5, built once per session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engine_support import OracleCheckpoints


class _Checkpoints(OracleCheckpoints):
    def get(self, arch: str, layout: str = "per_expert") -> tuple[Path, Any]:  # type: ignore[override]
        return super().get(arch, layout)


@pytest.fixture(scope="session")
def family_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> _Checkpoints:
    return _Checkpoints("oracle_minimax_kimi", tmp_path_factory)
