"""Gateways (issue 30, point 1): a person with no backbone and no weights finds two gateways in the
swarm, streams from the nearer, and when it is SIGKILLed mid generation resumes on the other with
the very tokens the single-process engine gives (greedy)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from moeswarm.demo import CHECKPOINT
from moeswarm.demo.swarm import start_daemon, stop_daemon
from moeswarm.model import SamplingParams, Tokenizer, generate, load_model

pytestmark = pytest.mark.slow

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
PROMPT = "And it came to pass"
NEW_TOKENS = 40


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _reference() -> list[int]:
    """The oracle: the single-process engine's greedy tokens for the same prompt."""
    model = load_model(CHECKPOINT)
    ids = Tokenizer.from_folder(CHECKPOINT, model.config.bos_token_id).encode(PROMPT)
    return list(generate(model, ids, SamplingParams(max_new_tokens=NEW_TOKENS,
                                                     stop_token_ids=model.config.eos_token_ids)))


async def _gateways_once_gone(boot: str, gone: str, timeout_s: float = 30.0) -> set[str]:
    """The peers of the gateway records the swarm holds, read (one DHT client) until ``gone`` is not among them."""
    from moeswarm.daemon import SwarmConfig, p2p_node
    from moeswarm.net.gateways import read_gateways
    from moeswarm.protocol import Identity

    async with p2p_node(Identity.generate(), SwarmConfig("", bootstrap=(boot,), client_mode=True)) as p2p:
        deadline = time.monotonic() + timeout_s
        while True:
            seen = {r.peer for r in await read_gateways(p2p)}
            if gone not in seen or time.monotonic() > deadline:
                return seen
            await asyncio.sleep(0.2)


def test_client_finds_two_gateways_streams_from_the_nearer_and_survives_its_sigkill(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from _delay import spawn_delay_proxy

    daemons, proxies = [], []
    try:
        # the holder 3 ms away from both gateways (each direction), so a token takes long enough to kill mid stream
        data = _free_port()
        proxies.append(spawn_delay_proxy("127.0.0.1:0", f"127.0.0.1:{data}", 0.003))
        daemons.append(start_daemon("node0", ["node", "--model", str(CHECKPOINT), "--port", str(data),
                                              "--announce-port", str(proxies[-1].port)]))
        boot = daemons[0].info["multiaddrs"][0]
        near = start_daemon("near", ["backbone", "--model", str(CHECKPOINT), "--bootstrap", boot,
                                     "--http", "127.0.0.1:0", "--gateway"])
        daemons.append(near)
        far_http = _free_port()  # the far gateway is reached through a 25 ms proxy, and announces the proxy
        proxies.append(spawn_delay_proxy("127.0.0.1:0", f"127.0.0.1:{far_http}", 0.025))
        far_url = f"http://127.0.0.1:{proxies[-1].port}"
        daemons.append(start_daemon("far", ["backbone", "--model", str(CHECKPOINT), "--bootstrap", boot,
                                            "--http", f"127.0.0.1:{far_http}", "--gateway", "--gateway-url", far_url]))
        far = daemons[-1]
        assert near.info["gateway"] == near.info["http"] and far.info["gateway"] == far_url

        client = subprocess.Popen(
            [sys.executable, "-m", "moeswarm.cli", "complete", "--swarm", boot, "--model", str(CHECKPOINT),
             "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS), "--print-token-ids"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
        timer = threading.Timer(120, client.kill)  # bounds the reads below
        timer.start()
        try:
            assert client.stdout is not None and client.stderr is not None
            first = client.stderr.readline()
            assert first == f"gateway {near.info['peer_id']} {near.info['gateway']}\n"
            assert client.stdout.read(1)  # the first piece of text has arrived from the near gateway
            near.process.send_signal(signal.SIGKILL)
            out, err = client.communicate(timeout=120)
        finally:
            timer.cancel()
        assert client.returncode == 0, err
        switches = [line for line in err.splitlines() if line.startswith("gateway ")]
        assert switches == [f"gateway {far.info['peer_id']} {far_url}"]
        assert json.loads(out.splitlines()[-1]) == _reference()

        # `moeswarm chat` through the one gateway left: the dead one is measured unreachable and skipped
        question = "Who led Israel out of Egypt?"
        chat = subprocess.run([sys.executable, "-m", "moeswarm.cli", "chat", "--swarm", boot, "--model",
                               str(CHECKPOINT / "config.json"), "--max-new-tokens", "12"], input=question + "\n",
                              capture_output=True, text=True, timeout=120, check=False,
                              env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
        assert chat.returncode == 0, chat.stderr
        assert [line for line in chat.stderr.splitlines() if line.startswith("gateway ")] == [
            f"gateway {far.info['peer_id']} {far_url}"]
        body = json.dumps({"messages": [{"role": "user", "content": question}], "max_tokens": 12,
                           "temperature": 0}).encode()
        request = urllib.request.Request(far.info["http"] + "/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            direct = json.loads(response.read())["choices"][0]["message"]["content"]
        assert direct and chat.stdout == direct + "\n"

        # a gateway stopped cleanly withdraws its record (one that expires at once); a killed one's stays
        # until it expires (60 s), and clients skip it as unreachable
        stop_daemon(far)
        assert asyncio.run(_gateways_once_gone(boot, far.info["peer_id"])) == {near.info["peer_id"]}
    finally:
        for d in reversed(daemons):
            stop_daemon(d)
        for p in proxies:
            p.close()
