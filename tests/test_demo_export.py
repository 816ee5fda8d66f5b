"""``moeswarm demo --export DIR``: the shipped checkpoint copied where a newcomer can pass it as --model
(issue 33, point 1: the README's ``./demo`` did not exist).  Checked byte for byte against the files in
the package, and by running ``generate`` on the copy against ``generate`` on the shipped folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from moeswarm.demo import CHECKPOINT

TIMEOUT = 300


def moeswarm(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "moeswarm.cli", *args], capture_output=True, text=True,
                          timeout=TIMEOUT, cwd=cwd)


def test_export_copies_the_checkpoint_and_generate_runs_on_the_copy(tmp_path: Path) -> None:
    out = moeswarm("demo", "--export", "demo", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"demo checkpoint copied to {tmp_path / 'demo'}"
    shipped = {p.name: p.read_bytes() for p in CHECKPOINT.iterdir() if p.is_file()}
    copied = {p.name: p.read_bytes() for p in (tmp_path / "demo").iterdir()}
    assert copied == shipped and "config.json" in copied and "model.safetensors" in copied
    args = ("--max-new-tokens", "6", "--print-token-ids")
    on_copy = moeswarm("generate", "--model", "./demo", *args, cwd=tmp_path)
    on_shipped = moeswarm("generate", "--model", str(CHECKPOINT), *args, cwd=tmp_path)
    assert on_copy.returncode == 0, on_copy.stderr[-2000:]
    assert on_copy.stdout == on_shipped.stdout and on_copy.stdout.strip()


def test_export_refuses_a_non_empty_folder_and_overwrites_nothing(tmp_path: Path) -> None:
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "config.json").write_text("mine")
    out = moeswarm("demo", "--export", "demo", cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip() == (f"error: cannot export the demo to {tmp_path / 'demo'}: the folder is not empty "
                                  "(choose a new or empty folder; nothing was overwritten)")
    assert [p.name for p in (tmp_path / "demo").iterdir()] == ["config.json"]
    assert (tmp_path / "demo" / "config.json").read_text() == "mine"


def test_export_into_an_empty_folder_is_allowed(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    out = moeswarm("demo", "--export", str(tmp_path / "empty"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "empty" / "model.safetensors").read_bytes() == (CHECKPOINT / "model.safetensors").read_bytes()
