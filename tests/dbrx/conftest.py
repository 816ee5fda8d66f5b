"""The oracle checkpoint of DBRX (``dbrx``), built once per session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engine_support import OracleCheckpoints


class _Checkpoints(OracleCheckpoints):
    def get(self) -> tuple[Path, Any]:  # type: ignore[override]
        return super().get()


@pytest.fixture(scope="session")
def dbrx_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> _Checkpoints:
    return _Checkpoints("oracle_dbrx", tmp_path_factory)
