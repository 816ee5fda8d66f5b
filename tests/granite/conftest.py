"""Oracle checkpoints of Granite MoE (``granitemoe``) and Granite MoE shared
(``granitemoeshared``), built once per session."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest


class GraniteCheckpoints:
    """``get(arch, layout)`` -> ``(folder, Reference)``: the tiny checkpoint ``oracle_granite`` builds
    (seed 0) and transformers' 16-token prefill + 8 greedy decode steps on it.  Read-only."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._cache: dict[tuple[str, str], tuple[Path, Any]] = {}

    @property
    def oracle(self) -> Any:
        return importlib.import_module("oracle_granite")

    def get(self, arch: str, layout: str = "per_expert") -> tuple[Path, Any]:
        if (arch, layout) not in self._cache:
            o = self.oracle
            folder = o.build_checkpoint(arch, layout, self.root / f"{arch}-{layout}")
            self._cache[(arch, layout)] = (folder, o.reference_run(folder, o.PROMPT))
        return self._cache[(arch, layout)]


@pytest.fixture(scope="session")
def granite_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> GraniteCheckpoints:
    return GraniteCheckpoints(tmp_path_factory.mktemp("granite"))
