"""Oracle checkpoints of GLM-4.5 (``glm4_moe``) and GLM-4.7-Flash (``glm4_moe_lite``), built once per session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engine_support import OracleCheckpoints


class _Checkpoints(OracleCheckpoints):
    def get(self, arch: str, layout: str = "per_expert") -> tuple[Path, Any]:  # type: ignore[override]
        return super().get(arch, layout)


@pytest.fixture(scope="session")
def glm4_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> _Checkpoints:
    return _Checkpoints("oracle_glm4", tmp_path_factory.mktemp("glm4"))
