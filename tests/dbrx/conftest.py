"""The oracle checkpoint of DBRX (``dbrx``), built once per session."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest


class DbrxCheckpoint:
    """``get()`` -> ``(folder, Reference)``: the tiny checkpoint ``oracle_dbrx`` builds (seed 0) and
    transformers' 16-token prefill + 8 greedy decode steps on it.  Read-only."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._built: tuple[Path, Any] | None = None

    @property
    def oracle(self) -> Any:
        return importlib.import_module("oracle_dbrx")

    def get(self) -> tuple[Path, Any]:
        if self._built is None:
            o = self.oracle
            folder = o.build_checkpoint(self.root / "dbrx")
            self._built = (folder, o.reference_run(folder, o.PROMPT))
        return self._built


@pytest.fixture(scope="session")
def dbrx_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> DbrxCheckpoint:
    return DbrxCheckpoint(tmp_path_factory.mktemp("dbrx"))
