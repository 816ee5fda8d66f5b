"""The README's walkthroughs run as written (issue 33, point 1: its examples used a ``./demo`` that did
not exist, and nothing said how to get a node's multiaddr out of ``READY``).  The fenced blocks marked
````bash walkthrough NAME[,NAME...] [daemon]`` (a block shared by several walkthroughs names them all) are taken from README.md verbatim and run in order in a fresh
folder, each as its own ``bash`` (a terminal), with ``moeswarm`` on the PATH as after
``. .venv/bin/activate``.  A ``daemon`` block keeps running (a node, a backbone): the next block starts
once it has printed its ``READY`` line.  The oracle for every generated text is the single-process
``moeswarm generate`` on the shipped checkpoint (itself checked against transformers in
test_engine_oracle.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from moeswarm.demo import CHECKPOINT

README = Path(__file__).resolve().parent.parent / "README.md"
READY_TIMEOUT = 180  # a daemon's start on a loaded 2-core machine
RUN_TIMEOUT = 300
TEE = re.compile(r"\| tee (\S+)")
BLOCK = re.compile(r"^```bash walkthrough ([\w,]+)( daemon)?\n(.*?)^```$", re.M | re.S)


def walkthrough(name: str) -> list[tuple[str, bool]]:
    """The README's blocks of walkthrough ``name``, in order, as (script, keeps running)."""
    return [(m[3], bool(m[2])) for m in BLOCK.finditer(README.read_text()) if name in m[1].split(",")]


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def env() -> dict[str, str]:
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


@dataclass
class Terminal:
    """A ``bash`` running one block that keeps running, its stdout read line by line."""

    proc: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)
    reader: threading.Thread | None = None

    def read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("READY "):
                self.ready.set()

    def stop(self) -> None:
        """Ctrl-C, as a person would press it (the whole pipeline: its process group)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        if self.reader is not None:
            self.reader.join(timeout=30)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


def run_walkthrough(name: str, cwd: Path, ready: list[dict] | None = None) -> subprocess.CompletedProcess[str]:
    """Run every block of ``name``; return what the last one (a block that ends) printed.  ``ready``
    receives each daemon's READY json."""
    blocks = walkthrough(name)
    assert blocks and not blocks[-1][1], f"walkthrough {name} must end with a block that ends"
    terminals: list[Terminal] = []
    try:
        for n, (script, keeps_running) in enumerate(blocks[:-1]):
            assert keeps_running, f"walkthrough {name}: only the last block may end"
            err = cwd / f".terminal-{n + 1}.stderr"  # for the messages below
            with open(err, "w") as err_file:
                proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", script], cwd=cwd, env=env(),
                                        stdout=subprocess.PIPE, stderr=err_file, text=True, start_new_session=True)
            term = Terminal(proc)
            terminals.append(term)
            term.reader = threading.Thread(target=term.read, daemon=True)
            term.reader.start()
            deadline = time.monotonic() + READY_TIMEOUT
            while not term.ready.wait(0.2):
                said = "".join(term.lines) + err.read_text()[-2000:]
                assert proc.poll() is None, f"{script!r} exited {proc.returncode}: {said}"
                assert time.monotonic() < deadline, f"{script!r} printed no READY line: {said}"
            for log in TEE.findall(script):  # tee writes our pipe before its file: a person reading the
                while "READY " not in _text(cwd / log):  # file a moment later sees the line, so wait for it
                    assert time.monotonic() < deadline, f"{script!r}: no READY line in {log}"
                    time.sleep(0.05)
            if ready is not None:
                ready.append(json.loads(next(ln for ln in term.lines if ln.startswith("READY "))[6:]))
        return subprocess.run(["bash", "-e", "-o", "pipefail", "-c", blocks[-1][0]], cwd=cwd, env=env(),
                              capture_output=True, text=True, timeout=RUN_TIMEOUT)
    finally:
        for term in reversed(terminals):
            term.stop()


def alone(*args: str) -> str:
    """What ``moeswarm generate`` prints in one process on the shipped checkpoint."""
    out = subprocess.run([sys.executable, "-m", "moeswarm.cli", "generate", "--model", str(CHECKPOINT), *args],
                         capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_the_walkthroughs_are_marked() -> None:
    assert [len(walkthrough(n)) for n in ("newcomer", "swarm", "volunteer", "api")] == [1, 2, 3, 3]
    assert "moeswarm demo --export ./demo" in walkthrough("swarm")[0][0]


def test_newcomer(tmp_path: Path) -> None:
    out = run_walkthrough("newcomer", tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    copied, _, text = out.stdout.partition("\n")
    assert copied == f"demo checkpoint copied to {tmp_path / 'demo'}"
    assert text == alone("--prompt", "And it came to pass", "--max-new-tokens", "24") and text.strip()


def test_a_swarm_in_two_terminals(tmp_path: Path) -> None:
    out = run_walkthrough("swarm", tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    addr, _, text = out.stdout.partition("\n")
    assert re.fullmatch(r"/ip4/127\.0\.0\.1/tcp/\d+/p2p/12D3KooW\w+", addr), out.stdout
    assert text == alone("--max-new-tokens", "24") and text.strip()
    peer = addr.rsplit("/", 1)[1]
    assert f"  {peer[-12:]}  layer 0:" in out.stderr, out.stderr[-2000:]  # --show-experts: the node served the experts


def test_a_second_volunteer_and_node_status(tmp_path: Path) -> None:
    daemons: list[dict] = []
    out = run_walkthrough("volunteer", tmp_path, daemons)
    assert out.returncode == 0, out.stderr[-2000:]
    first, second = daemons
    assert first["experts"] == [0, 7] and second["experts"] == [4, 7]
    for node in (first, second):  # every node on this machine is listed; ours among them
        assert f"node {node['peer_id']}" in out.stdout.replace("\n", " "), out.stdout[-3000:]


def test_a_backbone_serving_the_openai_api(tmp_path: Path) -> None:
    out = run_walkthrough("api", tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    single = alone("--prompt", "And it came to pass", "--max-new-tokens", "16")
    completion = out.stdout.strip()  # the API returns the completion; generate prints prompt + completion
    assert len(completion) > 20 and single.rstrip().endswith(completion), (completion, single)
