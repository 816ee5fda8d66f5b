"""Fixtures of the relay tests: certificates, exported shards, and daemons started as processes."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import IO, Any

import pytest

from moeswarm.relay.devcerts import DevCerts, make_dev_certs


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> DevCerts:
    """A private CA and a relay certificate for 127.0.0.1 signed by it."""
    return make_dev_certs(tmp_path_factory.mktemp("relay-certs"))


@pytest.fixture(scope="session")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> DevCerts:
    """Another private CA, which did not sign the relay's certificate."""
    return make_dev_certs(tmp_path_factory.mktemp("other-ca"), ca_name="someone else's CA")


@dataclass
class Proc:
    name: str
    process: subprocess.Popen[str]
    log: IO[str]
    info: dict[str, Any] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    _ready: threading.Event = field(default_factory=threading.Event)

    def wait_ready(self, timeout: float = 60.0) -> dict[str, Any]:
        if not self._ready.wait(timeout) or not self.info:
            self.stop()
            raise AssertionError(f"{self.name} printed no READY line within {timeout}s; stderr: {self.stderr()[-1500:]}")
        return self.info

    def stderr(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        return self.process.returncode


def _read(proc: Proc) -> None:
    assert proc.process.stdout is not None
    try:
        for line in proc.process.stdout:
            proc.lines.append(line)
            if line.startswith("READY ") and not proc.info:
                proc.info.update(json.loads(line[6:]))
                proc._ready.set()
    except (ValueError, OSError):
        pass
    finally:
        proc._ready.set()


@pytest.fixture
def spawn() -> Iterator[Callable[..., Proc]]:
    """``spawn(name, module, *args)`` runs ``python -m module args`` (READY is read in a thread);
    every process still running at the end of the test is stopped."""
    started: list[Proc] = []

    def start(name: str, module: str, *args: str) -> Proc:
        log = tempfile.NamedTemporaryFile("w+", prefix=f"relay-test-{name}-", suffix=".log")
        process = subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.PIPE, stderr=log,
                                   text=True, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
        proc = Proc(name, process, log)
        threading.Thread(target=_read, args=(proc,), daemon=True).start()
        started.append(proc)
        return proc

    yield start
    for proc in reversed(started):
        proc.stop()
        if proc.process.stdout is not None:
            proc.process.stdout.close()
        proc.log.close()


@pytest.fixture(scope="session")
def mixtral(oracle_checkpoints: Any) -> tuple[Path, Any]:
    return oracle_checkpoints.get("mixtral", "packed")


@pytest.fixture(scope="session")
def conformance() -> ModuleType:
    """``tests/relay/conformance.py``: the suite any relay implementation can run (loaded by path:
    it is a standalone script, not a test module)."""
    if "relay_conformance" not in sys.modules:
        spec = importlib.util.spec_from_file_location("relay_conformance", Path(__file__).with_name("conformance.py"))
        assert spec is not None and spec.loader is not None
        sys.modules["relay_conformance"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["relay_conformance"])
    return sys.modules["relay_conformance"]
