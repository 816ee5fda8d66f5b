"""Attack 9 of issue 12: browser attacks on the HTTP API.

A backbone serves the OpenAI-compatible API on 127.0.0.1. An attacker process sends what a web
page on another site can make a browser send: a ``text/plain`` POST (no CORS preflight), a
request whose Host is the attacker's name (DNS rebinding), one with a foreign Origin, and a
request for 100,000 tokens. On the base commit 7895ee0 the ``text/plain`` POST was accepted
and started a generation (CSRF), and Host and Origin were never looked at. Now they get 415,
421 and 403, and ``max_tokens`` above the cap gets 400. A backbone asked to serve the API on
every interface without ``--api-key`` refuses to start.
"""

from __future__ import annotations

import subprocess
import sys

from adversarial_support import attack

from moeswarm.demo import CHECKPOINT
from moeswarm.demo.swarm import start_daemon, stop_daemon


def test_cross_site_requests_are_refused_and_open_binds_need_a_key() -> None:
    backbone = start_daemon("backbone", ["backbone", "--model", str(CHECKPOINT), "--local-fallback",
                                         "--coverage-timeout", "1", "--http", "127.0.0.1:0"])
    try:
        result = attack("http", backbone.info["http"], "--timeout", "60")
        assert result == {"text_plain": 415, "rebinding_host": 421, "cross_origin": 403, "huge_max_tokens": 400}, result
    finally:
        stop_daemon(backbone)

    done = subprocess.run([sys.executable, "-m", "moeswarm.cli", "backbone", "--model", str(CHECKPOINT),
                           "--local-fallback", "--coverage-timeout", "1", "--http", "0.0.0.0:0"],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode != 0 and "--api-key" in done.stderr, (done.returncode, done.stderr[-1000:])
