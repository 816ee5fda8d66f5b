"""Oracle checkpoints of Granite MoE (``granitemoe``) and Granite MoE shared
(``granitemoeshared``), built once per session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engine_support import OracleCheckpoints


class _Checkpoints(OracleCheckpoints):
    def get(self, arch: str, layout: str = "per_expert") -> tuple[Path, Any]:  # type: ignore[override]
        return super().get(arch, layout)


@pytest.fixture(scope="session")
def granite_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> _Checkpoints:
    return _Checkpoints("oracle_granite", tmp_path_factory.mktemp("granite"))
