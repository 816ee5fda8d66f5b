"""Oracle checkpoints of Qwen3-Next (``qwen3_next``), built once per session."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest


class Qwen3NextCheckpoints:
    """``get(layout)`` -> ``(folder, Reference)``: the tiny checkpoint ``oracle_qwen3_next`` builds
    (seed 0) and transformers' 80-token prefill + 8 greedy decode steps on it.  Read-only."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._cache: dict[str, tuple[Path, Any]] = {}

    @property
    def oracle(self) -> Any:
        return importlib.import_module("oracle_qwen3_next")

    def get(self, layout: str = "per_expert") -> tuple[Path, Any]:
        if layout not in self._cache:
            o = self.oracle
            folder = o.build_checkpoint(layout, self.root / f"qwen3_next-{layout}")
            self._cache[layout] = (folder, o.reference_run(folder, o.PROMPT))
        return self._cache[layout]


@pytest.fixture(scope="session")
def qwen3_next_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Qwen3NextCheckpoints:
    return Qwen3NextCheckpoints(tmp_path_factory.mktemp("qwen3_next"))
