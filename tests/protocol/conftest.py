"""Fixtures shared by the protocol tests: the vector files and their generator."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

VECTORS = Path(__file__).resolve().parents[2] / "protocol_spec" / "vectors"


@pytest.fixture(scope="session")
def generator() -> ModuleType:
    """``protocol_spec/vectors/generate.py`` imported as a module."""
    spec = importlib.util.spec_from_file_location("moeswarm_vectors_generate", VECTORS / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def load_vector() -> Callable[[str], Any]:
    """Read one vector file (path relative to ``protocol_spec/vectors``)."""

    def load(name: str) -> Any:
        return json.loads((VECTORS / name).read_text(encoding="utf-8"))

    return load
