"""Oracle checkpoints of GLM-4.5 (``glm4_moe``) and GLM-4.7-Flash (``glm4_moe_lite``), built once per session."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest


class Glm4Checkpoints:
    """``get(arch, layout)`` -> ``(folder, Reference)``: the tiny checkpoint ``oracle_glm4`` builds
    (seed 0) and transformers' 16-token prefill + 8 greedy decode steps on it.  Read-only."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._cache: dict[tuple[str, str], tuple[Path, Any]] = {}

    @property
    def oracle(self) -> Any:
        return importlib.import_module("oracle_glm4")

    def get(self, arch: str, layout: str = "per_expert") -> tuple[Path, Any]:
        if (arch, layout) not in self._cache:
            o = self.oracle
            folder = o.build_checkpoint(arch, layout, self.root / f"{arch}-{layout}")
            self._cache[(arch, layout)] = (folder, o.reference_run(folder, o.PROMPT))
        return self._cache[(arch, layout)]


@pytest.fixture(scope="session")
def glm4_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Glm4Checkpoints:
    return Glm4Checkpoints(tmp_path_factory.mktemp("glm4"))
