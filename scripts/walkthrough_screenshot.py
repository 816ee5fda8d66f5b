"""Render docs/walkthrough.png: the README's "A swarm in two terminals", typed into two tmux panes.

    python scripts/walkthrough_screenshot.py [--out docs/walkthrough.png]

Runs the blocks of ``bash walkthrough swarm`` from README.md as a person would (terminal 1 in the top
pane, terminal 2 in the bottom one, in a fresh folder), captures both panes with their colours
(``tmux capture-pane -e``), turns the capture into SVG with rich (``Text.from_ansi``,
``Console.export_svg``) and photographs it in headless Chromium.  Needs tmux, jq and Debian's chromium
(Playwright drives it), ``moeswarm`` on the PATH."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"^```bash walkthrough [\w,]*\bswarm\b[\w,]*( daemon)?\n(.*?)^```$", re.M | re.S)
SOCKET = f"moeswarm-shot-{os.getpid()}"  # a tmux server of our own, stopped at the end
WIDTH = 118


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", "-L", SOCKET, *args], check=True, capture_output=True, text=True).stdout


def prompts(pane: str) -> int:
    return len(re.findall(r"^\$( |$)", tmux("capture-pane", "-p", "-J", "-t", pane), re.M))


def type_block(pane: str, script: str, last_keeps_running: bool) -> None:
    """Type each line once the shell is back at its prompt, as a person does."""
    lines = script.rstrip("\n").split("\n")
    for i, line in enumerate(lines):
        before = prompts(pane)
        tmux("send-keys", "-t", pane, "-l", line)
        tmux("send-keys", "-t", pane, "Enter")
        if i < len(lines) - 1 or not last_keeps_running:
            deadline = time.monotonic() + 300
            while prompts(pane) <= before:
                if time.monotonic() > deadline:
                    sys.exit(f"{line!r} did not finish:\n" + tmux("capture-pane", "-p", "-t", pane))
                time.sleep(0.3)


def wait_for(pane: str, pattern: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not re.search(pattern, tmux("capture-pane", "-p", "-J", "-t", pane), re.M):
        if time.monotonic() > deadline:
            sys.exit(f"gave up waiting for {pattern!r} in pane {pane}:\n" + tmux("capture-pane", "-p", "-t", pane))
        time.sleep(0.5)


def render(panes: list[tuple[str, str]], out: Path) -> None:
    from rich.console import Console
    from rich.rule import Rule
    from rich.text import Text

    console = Console(record=True, width=WIDTH, file=open(os.devnull, "w"), force_terminal=True)
    for title, ansi in panes:
        console.print(Rule(title, style="bold cyan"))
        console.print(Text.from_ansi(ansi.rstrip("\n")))
    svg = console.export_svg(title="A swarm in two terminals (README)")
    sys.path.insert(0, str(ROOT / "tests"))
    from browser_support import chromium_page

    with tempfile.TemporaryDirectory() as tmp:
        html = f'<html><body style="margin:0"><div id="shot" style="width:1200px">{svg}</div></body></html>'
        (Path(tmp) / "shot.html").write_text(html)
        with chromium_page(width=1240, height=900) as page:
            page.goto((Path(tmp) / "shot.html").as_uri())
            page.locator("#shot").screenshot(path=str(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "walkthrough.png")
    args = parser.parse_args()
    (first, _), (second, _) = [(m[2], m[1]) for m in BLOCK.finditer((ROOT / "README.md").read_text())]
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    keep = " ".join(f"{k}={shlex.quote(os.environ[k])}" for k in ("PYTHONPATH", "OPENBLAS_NUM_THREADS") if k in os.environ)
    shell = f"env PS1='$ ' PATH={shlex.quote(path)} {keep} bash --norc --noprofile"
    with tempfile.TemporaryDirectory() as cwd:
        subprocess.run(["tmux", "-L", SOCKET, "-f", "/dev/null", "new-session", "-d", "-x", str(WIDTH), "-y", "40",
                        "-c", cwd, shell], check=True)
        try:
            tmux("split-window", "-v", "-c", cwd, shell)
            top, bottom = "0.0", "0.1"
            type_block(top, first, last_keeps_running=True)
            wait_for(top, r"^READY ", 180)
            type_block(bottom, second, last_keeps_running=False)
            panes = [(f"terminal {i + 1}", tmux("capture-pane", "-p", "-e", "-J", "-t", p)) for i, p in
                     enumerate((top, bottom))]
            tmux("send-keys", "-t", top, "C-c")
            wait_for(top, r"^\$ ?$", 30)
        finally:
            subprocess.run(["tmux", "-L", SOCKET, "kill-server"], capture_output=True)
    render(panes, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
