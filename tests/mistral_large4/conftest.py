"""The oracle checkpoints of Mistral Large 4 (``mistral_large4``), one per layout, built once per session."""

from __future__ import annotations

import pytest
from engine_support import OracleCheckpoints


@pytest.fixture(scope="session")
def ml4_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> OracleCheckpoints:
    return OracleCheckpoints("oracle_mistral_large4", tmp_path_factory)
