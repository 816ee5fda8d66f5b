"""Headless Chromium from Debian, driven by Playwright, for the tests of web pages.

Playwright's own browser download cannot work on these machines; Debian's ``chromium`` package
is installed by the test setup when missing (as root), else the test fails saying what to install.
Playwright is started inside the test (``sync_playwright``) and stopped with it, so no event loop
outlives the test (the suite's other tests run their own with ``asyncio.run``)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]


def chromium_path() -> str:
    """Debian's Chromium, installed with apt-get when missing (root only)."""
    if os.path.exists(CHROMIUM):
        return CHROMIUM
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.fail("the browser tests need Debian's Chromium: apt-get install -y chromium (as root)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=600)
    done = subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], env=env, capture_output=True, text=True,
                          timeout=1200)
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"apt-get install -y chromium failed: {done.stderr[-1000:]}")
    return CHROMIUM


@contextlib.contextmanager
def chromium_page(width: int = 1400, height: int = 900) -> Iterator[Any]:
    """A page in a fresh headless Chromium (a new profile each time)."""
    from playwright.sync_api import sync_playwright

    path = chromium_path()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=path, headless=True, args=ARGS)
        try:
            yield browser.new_page(viewport={"width": width, "height": height})
        finally:
            browser.close()
