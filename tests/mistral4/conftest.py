"""The oracle checkpoint of Mistral Small 4 (``mistral4``), built once per session."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest


class Mistral4Checkpoint:
    """``get()`` -> ``(folder, Reference)``: the tiny checkpoint ``oracle_mistral4`` builds (seed 0) and
    transformers' 16-token prefill + 8 greedy decode steps on it.  Read-only."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._built: tuple[Path, Any] | None = None

    @property
    def oracle(self) -> Any:
        return importlib.import_module("oracle_mistral4")

    def get(self) -> tuple[Path, Any]:
        if self._built is None:
            o = self.oracle
            folder = o.build_checkpoint(self.root / "mistral4")
            self._built = (folder, o.reference_run(folder, o.PROMPT))
        return self._built


@pytest.fixture(scope="session")
def mistral4_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Mistral4Checkpoint:
    return Mistral4Checkpoint(tmp_path_factory.mktemp("mistral4"))
