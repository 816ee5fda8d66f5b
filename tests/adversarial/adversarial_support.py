"""Shared by the adversarial tests: the attacker process, and what a victim process holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ATTACKER = Path(__file__).with_name("attacker.py")
BASE_COMMIT = "7895ee0"  # the branch's base: every test here fails there (see each docstring)


def attack(*args: str, timeout: float = 300.0) -> dict[str, Any]:
    """Run the attacker process to completion; its last JSON line."""
    done = subprocess.run([sys.executable, str(ATTACKER), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and lines, f"attacker failed ({done.returncode}): {done.stderr[-2000:]}"
    return json.loads(lines[-1])


def start_attacker(*args: str) -> subprocess.Popen[str]:
    """An attacker that holds what it opened until its stdin is closed (``hold``, ``relay-streams``)."""
    return subprocess.Popen([sys.executable, str(ATTACKER), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})


def first_line(process: subprocess.Popen[str]) -> dict[str, Any]:
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line.startswith("{"), f"attacker said {line!r}; stderr: {process.stderr.read()[-2000:] if process.stderr else ''}"
    return json.loads(line)


def finish(process: subprocess.Popen[str], timeout: float = 60.0) -> dict[str, Any]:
    """Close the attacker's stdin (it lets go) and read its report."""
    out, err = process.communicate("\n", timeout=timeout)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, f"attacker said nothing; stderr: {err[-2000:]}"
    return json.loads(lines[-1])


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def reset_peak_rss(pid: int) -> None:
    """Reset the process's VmHWM to its current RSS (Linux: ``echo 5 > /proc/PID/clear_refs``)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def rss_kib(pid: int, field: str = "VmHWM") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")
