"""An emulated network link between two network namespaces, for benchmarks (needs root + iproute2).

This kernel has no netem, so the link is built from what it has: a veth pair joins namespaces
``ns_a`` and ``ns_b``; each direction's bandwidth is shaped in the kernel by a tbf qdisc on the
sending side's veth; the round trip is added by the precise userspace delay proxy
(``benchmarks/_delay.py``, rtt/2 each way) running as a process inside ``ns_b``:

    process in ns_a -> veth (tbf a_to_b) -> proxy on addr_b (rtt/2) -> 127.0.0.1:target in ns_b (lo)
    and back:  target -> proxy (rtt/2) -> veth (tbf b_to_a) -> ns_a

    with emulated_link(rtt_ms=3.4, a_to_b_mbit=89, b_to_a_mbit=49) as link:
        server = link.run(link.ns_b, [sys.executable, "server.py", "--port", "9000"])
        port = link.delayed_port(9000)  # wait until the server listens first
        client = link.run(link.ns_a, [sys.executable, "client.py", f"{link.addr_b}:{port}"])

The proxy always runs, also at rtt 0 (then it only forwards), so a target in ns_b listens on
127.0.0.1 whatever the link.  tbf parameters: ``rate`` the asked Mbit/s (tc's mbit = 10**6
bit/s, counted on Ethernet frames, so TCP goodput is ~4% lower); ``burst`` 1 ms worth of the
rate, at least 4 KiB (smaller bursts cost throughput in tbf's GSO segmentation, larger ones let
small messages skip their serialisation time); ``latency`` 20 ms of queue before tbf drops
(a bulk transfer fills it: pings that share the link then wait up to that long, as on a real
bloated uplink).  ``None`` leaves a direction unshaped.

Everything ``emulated_link`` makes is removed on exit, also after an exception or Ctrl-C: the
processes started with ``run`` and ``delayed_port`` (and anything else left in the two
namespaces) are stopped, then the namespaces deleted, which deletes the veth pair.  Names carry
this process's pid and a random suffix; entering also deletes namespaces that earlier, killed
runs left behind.

``delayed_swarm`` is the loopback alternative for a swarm: expert nodes whose data plane goes
through delay proxies (no namespaces, no shaping, no root).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from _delay import ProxyProcess, spawn_delay_proxy  # benchmarks/_delay.py
from moeswarm.demo.swarm import Daemon, expert_nodes

PREFIX = "moeswarm-link"
_NAME = re.compile(rf"^{PREFIX}-(\d+)-[0-9a-f]{{6}}-[ab]$")
QUEUE_MS = 20  # tbf latency: the longest a packet waits in the shaper's queue
MIN_BURST = 4096  # bytes


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10).stdout


def _netns_exec(ns: str) -> list[str]:
    return ["ip", "netns", "exec", ns]


@dataclass
class Link:
    """What ``emulated_link`` yields: the two namespaces and their addresses on the veth pair."""

    ns_a: str
    ns_b: str
    addr_a: str
    addr_b: str
    rtt_ms: float
    _processes: list[subprocess.Popen[Any]] = field(default_factory=list, init=False, repr=False)
    _proxies: list[ProxyProcess] = field(default_factory=list, init=False, repr=False)

    def run(self, ns: str, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside namespace ``ns``; it is stopped (if still running) when the link closes."""
        if ns not in (self.ns_a, self.ns_b):
            raise ValueError(f"{ns!r} is not one of this link's namespaces")
        process = subprocess.Popen([*_netns_exec(ns), *argv], **popen_kwargs)
        self._processes.append(process)
        return process

    def delayed_port(self, target_port: int) -> int:
        """A port on ``addr_b`` whose connections reach 127.0.0.1:target_port in ns_b, delayed by
        rtt/2 each way (a new proxy process per call)."""
        proxy = spawn_delay_proxy(f"{self.addr_b}:0", f"127.0.0.1:{target_port}", self.rtt_ms / 2e3,
                                  prefix=_netns_exec(self.ns_b))
        self._proxies.append(proxy)
        return proxy.port

    def _stop(self) -> None:
        for proxy in self._proxies:
            proxy.close()
        for process in self._processes:
            _terminate(process)


def _terminate(process: subprocess.Popen[Any], timeout_s: float = 5.0) -> None:
    """SIGTERM, SIGKILL if it hangs; then close the pipes the caller asked ``run`` for."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout_s)
    for stream in (process.stdin, process.stdout, process.stderr):
        if stream is not None:
            stream.close()


def _delete_namespace(ns: str) -> None:
    """Stop what still runs inside ``ns`` (only processes this module started get there), then delete it."""
    with contextlib.suppress(subprocess.SubprocessError):
        for sig in (signal.SIGTERM, signal.SIGKILL):  # SIGKILL for what ignored SIGTERM
            pids = [int(p) for p in _ip("netns", "pids", ns).split()]
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline and _ip("netns", "pids", ns).split():
                time.sleep(0.05)
    with contextlib.suppress(subprocess.SubprocessError):
        _ip("netns", "delete", ns)


def namespaces() -> list[str]:
    """This module's namespaces that exist now (of every run)."""
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.startswith(PREFIX + "-")]


def sweep_stale() -> None:
    """Delete namespaces left by runs whose process is gone (killed before it could clean up)."""
    for ns in namespaces():
        match = _NAME.match(ns)
        if match is None:
            continue
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            _delete_namespace(ns)
        except PermissionError:
            pass  # alive, someone else's


def _shape(ns: str, dev: str, mbit: float | None) -> None:
    if mbit is None:
        return
    burst = max(int(mbit * 1e6 / 8 * 1e-3), MIN_BURST)  # 1 ms of traffic
    subprocess.run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
                    "burst", str(burst), "latency", f"{QUEUE_MS}ms"], check=True, capture_output=True, timeout=10)


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Ctrl-C during cleanup is held until the cleanup is done (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda sig, _frame: caught.append(sig))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


@contextlib.contextmanager
def emulated_link(rtt_ms: float = 0.0, a_to_b_mbit: float | None = None,
                  b_to_a_mbit: float | None = None) -> Iterator[Link]:
    """Two namespaces joined by a shaped veth pair (see the module docstring)."""
    if rtt_ms < 0 or any(m is not None and m <= 0 for m in (a_to_b_mbit, b_to_a_mbit)):
        raise ValueError("rtt_ms must be >= 0 and bandwidths > 0 (or None for unshaped)")
    sweep_stale()
    tag = secrets.token_hex(3)
    name = f"{PREFIX}-{os.getpid()}-{tag}"
    subnet = f"10.77.{int(tag, 16) % 256}"
    link = Link(f"{name}-a", f"{name}-b", f"{subnet}.1", f"{subnet}.2", rtt_ms)
    created: list[str] = []
    try:
        for ns in (link.ns_a, link.ns_b):
            _ip("netns", "add", ns)
            created.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        # both ends are created inside their namespaces: nothing appears in the host's namespace
        _ip("link", "add", "veth-a", "netns", link.ns_a, "type", "veth", "peer", "name", "veth-b", "netns", link.ns_b)
        for ns, dev, addr, mbit in ((link.ns_a, "veth-a", link.addr_a, a_to_b_mbit),
                                    (link.ns_b, "veth-b", link.addr_b, b_to_a_mbit)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _shape(ns, dev, mbit)
        yield link
    finally:
        with _sigint_deferred():
            try:
                link._stop()
            finally:
                for ns in created:
                    _delete_namespace(ns)


# ---------------------------------------------------------------- a delayed swarm on loopback


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def mtp_layers(model_dir: str) -> str:
    """The nodes' --layers for a ``moeswarm backbone --draft mtp``: the decoder's layers and the
    checkpoint's multi-token-prediction layers after them ("0-4" on the demo)."""
    from moeswarm.model import load_config

    return f"0-{load_config(model_dir).all_layers - 1}"


@contextlib.contextmanager
def delayed_swarm(model_dir: str, expert_ranges: Sequence[str], rtt_ms: float,
                  layers: str | None = None) -> Iterator[list[Daemon]]:
    """Expert nodes on loopback, one per range of experts ("0-3"), the first the bootstrap peer;
    each announces a delay proxy's port (a process, rtt/2 each way) instead of its own, so every
    data-plane call pays ``rtt_ms``; the DHT traffic is not delayed.  ``info["endpoint"]`` is the
    delayed endpoint.  No namespaces: loopback only, no root needed.  ``layers``: the nodes'
    --layers (e.g. "0-4": the demo's decoder and its MTP layer)."""
    proxies: list[ProxyProcess] = []

    def behind_a_proxy(i: int) -> list[str]:
        port = _free_port()
        proxies.append(spawn_delay_proxy("127.0.0.1:0", f"127.0.0.1:{port}", rtt_ms / 2e3))
        return ["--port", str(port), "--announce-port", str(proxies[-1].port)] + (["--layers", layers] if layers else [])

    try:
        with expert_nodes(model_dir, expert_ranges, extra_args=behind_a_proxy) as daemons:
            yield daemons
    finally:
        for proxy in proxies:
            proxy.close()
