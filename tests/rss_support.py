"""``moeswarm generate --stats`` in a subprocess with its resident set sampled from outside (the memory tests)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path


def generate_sampling_rss(model: Path, prompt_ids: str, tokens: int, *extra: str,
                          timeout_s: float = 300) -> tuple[list[int], int, str]:
    """Generate in a subprocess; returns (its tokens, its peak VmRSS in bytes sampled every ~2 ms, stderr)."""
    proc = subprocess.Popen([sys.executable, "-m", "moeswarm.cli", "generate", "--model", str(model), "--prompt-ids",
                             prompt_ids, "--max-new-tokens", str(tokens), "--print-token-ids", "--stats", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak, done = 0, threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            try:
                for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        peak = max(peak, int(line.split()[1]) * 1024)
            except (OSError, ValueError):
                return
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        done.set()
        sampler.join()
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1]), peak, err
