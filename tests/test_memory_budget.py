"""A checkpoint several times larger than the memory budget: generation stays under the budget
(resident set sampled from outside the process during the run) and gives the same tokens."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from moeswarm.model.memory import parse_size
from moeswarm.model.synthetic import random_mixtral
from rss_support import generate_sampling_rss

pytestmark = pytest.mark.slow
BUDGET = "100MiB"


def run(folder: Path, *extra: str) -> tuple[list[int], int, str]:
    """Generate in a subprocess; returns (tokens, peak VmRSS sampled every ~2 ms, stderr)."""
    return generate_sampling_rss(folder, "[5, 6, 7, 8, 9, 10]", 10, *extra)


def test_generation_stays_within_the_memory_budget(tmp_path: Path) -> None:
    folder = random_mixtral(tmp_path / "m", hidden=512, inter=1536, layers=6, experts=8, vocab=4096, heads=8,
                            kv_heads=2)
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    budget = parse_size(BUDGET)
    assert size > 4 * budget
    free_tokens, free_peak, _ = run(folder)
    tokens, peak, err = run(folder, "--memory-budget", BUDGET)
    assert tokens == free_tokens
    assert peak <= budget, f"resident set peaked at {peak / 2**20:.0f} MiB"
    assert free_peak > 2 * budget  # the unconstrained run really needed more: the budget did the work
    assert "expert evictions" in err and "MB read from disk" in err


def test_a_budget_below_the_baseline_is_a_clear_error(tmp_path: Path) -> None:
    folder = random_mixtral(tmp_path / "m", hidden=128, inter=256, layers=1, experts=4, vocab=256, heads=4, kv_heads=2)
    r = subprocess.run([sys.executable, "-m", "moeswarm.cli", "generate", "--model", str(folder), "--prompt-ids", "[1]",
                        "--memory-budget", "1MB"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "memory-budget" in r.stderr and len(r.stderr.strip().splitlines()) == 1
