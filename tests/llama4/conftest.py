"""Oracle checkpoints of Llama 4 (``llama4_text`` and ``llama4``), built once per session."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest


class Llama4Checkpoints:
    """``get(layout)`` -> ``(folder, Reference)``: the tiny checkpoint ``oracle_llama4`` builds (seed 0) and
    transformers' 16-token prefill + 8 greedy decode steps on it.  Read-only."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._cache: dict[str, tuple[Path, Any]] = {}

    @property
    def oracle(self) -> Any:
        return importlib.import_module("oracle_llama4")

    def get(self, layout: str = "text") -> tuple[Path, Any]:
        if layout not in self._cache:
            o = self.oracle
            folder = o.build_checkpoint(layout, self.root / layout)
            self._cache[layout] = (folder, o.reference_run(folder, o.PROMPT))
        return self._cache[layout]


@pytest.fixture(scope="session")
def llama4_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Llama4Checkpoints:
    return Llama4Checkpoints(tmp_path_factory.mktemp("llama4"))
