"""Oracle checkpoints of DeepSeek-V4 (``deepseek_v4``), built once per session."""

from __future__ import annotations

import pytest
from engine_support import OracleCheckpoints


@pytest.fixture(scope="session")
def dsv4_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> OracleCheckpoints:
    return OracleCheckpoints("oracle_dsv4", tmp_path_factory)
