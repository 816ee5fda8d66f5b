"""Oracle checkpoints of dots.llm1 (``dots1``), ERNIE 4.5 MoE (``ernie4_5_moe``) and Hunyuan-A13B
(``hunyuan_v1_moe``), built once per session."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest


class FamilyCheckpoints:
    """``get(arch, layout)`` -> ``(folder, Reference)``: the tiny checkpoint ``oracle_families`` builds
    (seed 0) and transformers' 16-token prefill + 8 greedy decode steps on it.  Read-only."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._cache: dict[tuple[str, str], tuple[Path, Any]] = {}

    @property
    def oracle(self) -> Any:
        return importlib.import_module("oracle_families")

    def get(self, arch: str, layout: str = "per_expert") -> tuple[Path, Any]:
        if (arch, layout) not in self._cache:
            o = self.oracle
            folder = o.build_checkpoint(arch, layout, self.root / f"{arch}-{layout}")
            self._cache[(arch, layout)] = (folder, o.reference_run(folder, o.PROMPT))
        return self._cache[(arch, layout)]


@pytest.fixture(scope="session")
def family_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> FamilyCheckpoints:
    return FamilyCheckpoints(tmp_path_factory.mktemp("families"))
