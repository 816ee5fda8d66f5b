"""The shipped demo: a small Mixtral-style checkpoint trained on public-domain text."""

from __future__ import annotations

from pathlib import Path

CHECKPOINT = Path(__file__).resolve().parent / "checkpoint"
DEFAULT_PROMPT = "And it came to pass"
