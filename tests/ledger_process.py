"""``moeswarm-ledger serve`` as the operator runs it: a subprocess, ready once its READY line is read
(the ledger tests and the ledger attack tests both start it this way)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class LedgerProcess:
    """``moeswarm-ledger serve`` in a subprocess, ready (its READY line read)."""

    process: subprocess.Popen[str]
    info: dict[str, Any]
    log: Path

    @property
    def url(self) -> str:
        return str(self.info["url"])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        if self.process.stdout is not None:
            self.process.stdout.close()


def start_ledger(args: list[str], log: Path, timeout_s: float = 90.0) -> LedgerProcess:
    """Start ``python -m moeswarm.ledger.cli serve ARGS`` and wait for its READY line."""
    with open(log, "ab") as err:
        process = subprocess.Popen([sys.executable, "-m", "moeswarm.ledger.cli", "serve", *args],
                                   stdout=subprocess.PIPE, stderr=err, text=True,
                                   env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    found: dict[str, Any] = {}
    done = threading.Event()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith("READY ") and not found:
                found.update(json.loads(line[6:]))
                done.set()
        done.set()

    threading.Thread(target=read, daemon=True).start()
    if not done.wait(timeout_s) or not found:
        process.kill()
        process.wait(5)
        raise AssertionError(f"the ledger did not get ready: {log.read_text()[-2000:]}")
    return LedgerProcess(process, found, log)
