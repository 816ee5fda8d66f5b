"""Continuous batching with real processes: a backbone and three expert nodes on loopback.
Eight concurrent greedy completions each return exactly the text they return alone, in fewer
expert calls than one at a time, and the backbone's memory stays within its cache pool."""

from __future__ import annotations

import json
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from moeswarm.demo import CHECKPOINT
from moeswarm.demo.swarm import local_swarm, start_daemon, stop_daemon
from moeswarm.model import Tokenizer, load_config

pytestmark = pytest.mark.slow

PROMPTS = ["And it came to pass", "In the beginning", "The LORD is my shepherd", "And God said",
           "Blessed are the meek", "Then Moses", "And the king said unto", "For unto us"]
KV_CACHE = 4 << 20  # bytes


def get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=60) as response:
        return json.loads(response.read())


def complete(url: str, prompt: str) -> str:
    body = json.dumps({"prompt": prompt, "max_tokens": 24, "temperature": 0}).encode()
    request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())["choices"][0]["text"]


def activations_kb() -> int:
    """What one batched forward pass over all eight prompts at once (the widest step) holds, float32,
    counted from the config: per token the residual, its norm, q, k, v, the attention and projection
    outputs (6.0 x hidden with 2 of 4 KV heads), the router's logits, gate, up, act and down of each of
    top_k experts, the rows sent to and received from expert nodes (x 2 for the codec's copies), the
    logits; counted twice (a step's buffers live while the next are allocated)."""
    cfg = load_config(CHECKPOINT)
    tokens = sum(len(ids) for ids in map(Tokenizer.from_folder(CHECKPOINT).encode, PROMPTS))
    per_token = (6 * cfg.hidden_size + cfg.num_experts + cfg.top_k * (3 * cfg.moe_intermediate_size + cfg.hidden_size)
                 + 4 * cfg.top_k * cfg.hidden_size + cfg.vocab_size)
    return 2 * tokens * per_token * 4 >> 10


def rss_kb(pid: int, field: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(field + ":"))


def test_eight_concurrent_completions_equal_each_alone() -> None:
    with local_swarm(str(CHECKPOINT), 3, experts_per_layer=8) as nodes:
        backbone = start_daemon("backbone", ["backbone", "--model", str(CHECKPOINT), "--bootstrap",
                                             nodes[0].info["multiaddrs"][0], "--http", "127.0.0.1:0",
                                             "--kv-cache", str(KV_CACHE),
                                             # the output checks keep float32 copies of the experts they
                                             # recompute (a cache of their own): this test bounds the KV pool
                                             "--verify-fraction", "0", "--probation-calls", "0"])
        try:
            url, pid = backbone.info["http"], backbone.process.pid
            complete(url, PROMPTS[0])  # one request: first-touch pages of the model, the runtime, a connection
            warm_peak = rss_kb(pid, "VmHWM")
            calls0 = get(url + "/status")["dispatch"]["calls"]
            alone = [complete(url, p) for p in PROMPTS]
            calls1 = get(url + "/status")["dispatch"]["calls"]
            samples, done = [], threading.Event()
            sampler = threading.Thread(target=lambda: [samples.append(rss_kb(pid)) for _ in iter(lambda: done.wait(0.01), True)])
            sampler.start()
            try:
                with ThreadPoolExecutor(len(PROMPTS)) as pool:
                    together = list(pool.map(lambda p: complete(url, p), PROMPTS))
            finally:
                done.set()
                sampler.join(10)
            calls2 = get(url + "/status")["dispatch"]["calls"]
            assert all(alone) and together == alone
            # batched: one request per holder per MoE layer carries every sequence's rows
            assert calls2 - calls1 < (calls1 - calls0) / 3, (calls1 - calls0, calls2 - calls1)
            # eight sequences at once cost no more memory than the cache pool and their activations
            print(f"growth {max(samples) - warm_peak} kB; bound: KV pool {KV_CACHE >> 10} kB "
                  f"+ activations {activations_kb()} kB")
            assert samples and max(samples) <= warm_peak + (KV_CACHE >> 10) + activations_kb(), \
                (warm_peak, max(samples), activations_kb())
        finally:
            stop_daemon(backbone)
