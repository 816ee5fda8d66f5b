"""GGUF files converted from the oracle checkpoints, built once per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import llama_cpp_tools
import pytest


class GGUFCheckpoints:
    """``get(arch, weight_type, experts_type=None)`` -> path of the GGUF that ``convert_to_gguf`` writes
    from the oracle's per_expert checkpoint of ``arch`` (no sidecar files)."""

    def __init__(self, root: Path, oracle_checkpoints) -> None:  # type: ignore[no-untyped-def]
        self.root = root
        self.oracle = oracle_checkpoints
        self._cache: dict[tuple[str, str, str | None], Path] = {}

    def get(self, arch: str, weight_type: str, experts_type: str | None = None) -> Path:
        from moeswarm.model.gguf import convert_to_gguf

        key = (arch, weight_type, experts_type)
        if key not in self._cache:
            folder, _ = self.oracle.get(arch, "per_expert")
            out = self.root / f"{arch}.{weight_type}.{experts_type or weight_type}.gguf"
            convert_to_gguf(folder, out, weight_type=weight_type, experts_type=experts_type, sidecar=False)
            self._cache[key] = out
        return self._cache[key]


@pytest.fixture(scope="session")
def gguf_checkpoints(tmp_path_factory, oracle_checkpoints) -> GGUFCheckpoints:  # type: ignore[no-untyped-def]
    return GGUFCheckpoints(tmp_path_factory.mktemp("gguf"), oracle_checkpoints)


@pytest.fixture(scope="session")
def family_oracles(tmp_path_factory):  # type: ignore[no-untyped-def]
    """``get(module, *key)`` -> (folder, Reference) of a family's oracle checkpoint (tests/oracle_*.py), each
    built once per run (the same folders as the family's own tests use)."""
    from engine_support import OracleCheckpoints

    oracles: dict[str, OracleCheckpoints] = {}

    class _Get:
        def get(self, module: str, *key: str):  # type: ignore[no-untyped-def]
            if module not in oracles:
                oracles[module] = OracleCheckpoints(module, tmp_path_factory)
            return oracles[module].get(*key)

    return _Get()


@pytest.fixture(scope="session")
def llama_cpp_src() -> Iterator[Path]:
    """llama.cpp's converter (``llama_cpp_tools.converter_source``): MOESWARM_LLAMA_CPP_SRC, or llama-cpp-python
    0.3.36's sdist downloaded from PyPI once into the test cache; a failed download fails the test saying so."""
    yield llama_cpp_tools.converter_source()
    llama_cpp_tools.close_converters()
