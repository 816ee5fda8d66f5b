"""The volunteer page's JavaScript: node's test runner (wire code against the protocol vectors)
and ESLint, run from the Python suite so `pytest` covers them.

Needs Node.js >= 20 (`apt-get install nodejs npm`); ESLint 9.9.1 is installed with npm into
~/.cache/moeswarm-eslint by the test setup when missing (or set MOESWARM_ESLINT to an eslint binary)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ESLINT_DIR = Path.home() / ".cache" / "moeswarm-eslint"
ESLINT_PACKAGES = ["eslint@9.9.1"]


def node() -> str:
    path = shutil.which("node")
    if path is None:
        pytest.fail("the JavaScript tests need Node.js >= 20: apt-get install -y nodejs npm")
    version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    if int(version.lstrip("v").split(".")[0]) < 20:
        pytest.fail(f"the JavaScript tests need Node.js >= 20, found {version}")
    return path


@pytest.fixture(scope="session")
def eslint() -> str:
    if os.environ.get("MOESWARM_ESLINT"):
        return os.environ["MOESWARM_ESLINT"]
    binary = ESLINT_DIR / "node_modules" / ".bin" / "eslint"
    if not binary.exists():
        npm = shutil.which("npm")
        if npm is None:
            pytest.fail("ESLint is installed with npm, which is missing: apt-get install -y npm")
        ESLINT_DIR.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(ESLINT_DIR), *ESLINT_PACKAGES],
                              capture_output=True, text=True, timeout=600)
        if not binary.exists():
            pytest.fail(f"npm install {' '.join(ESLINT_PACKAGES)} failed: {done.stderr[-1500:]}")
    return str(binary)


def test_node_unit_tests_pass() -> None:
    done = subprocess.run([node(), "--test", "tests/web/js/"], cwd=REPO, capture_output=True, text=True, timeout=300)
    print(done.stdout[-3000:])
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    passed = int(re.search(r"^# pass (\d+)$", done.stdout, re.M).group(1))  # type: ignore[union-attr]
    failed = int(re.search(r"^# fail (\d+)$", done.stdout, re.M).group(1))  # type: ignore[union-attr]
    assert failed == 0 and passed >= 10, (passed, failed)


def test_eslint_finds_nothing(eslint: str) -> None:
    done = subprocess.run([eslint, "--config", "tests/web/eslint.config.mjs", "--max-warnings", "0",
                           "moeswarm/web/static/js", "tests/web/js"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
