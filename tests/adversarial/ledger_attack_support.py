"""Helpers of the ledger and market attack tests: the operator's processes (``moeswarm-ledger serve``,
its command line) and the attackers' (scripts in ``attackers/``), each its own Python process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ledger_process import LedgerProcess, start_ledger

__all__ = ["ATTACKERS", "ENV", "LedgerProcess", "attacker", "ledger_cli", "start_ledger"]

ATTACKERS = Path(__file__).resolve().parent / "attackers"
ENV = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}


def ledger_cli(*args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    """``moeswarm-ledger ARGS`` as the operator runs it."""
    return subprocess.run([sys.executable, "-m", "moeswarm.ledger.cli", *args], capture_output=True, text=True,
                          env=ENV, timeout=timeout_s, check=False)


def attacker(script: str, *args: str, timeout_s: float = 600.0) -> dict[str, Any]:
    """Run ``attackers/SCRIPT ARGS`` as its own process; its last stdout line is JSON."""
    out = subprocess.run([sys.executable, str(ATTACKERS / script), *args], capture_output=True, text=True,
                         env=ENV, timeout=timeout_s, check=False)
    assert out.returncode == 0, f"attacker {script} failed: {out.stderr[-3000:]}"
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))
