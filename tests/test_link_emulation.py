"""benchmarks/_links.py: the emulated link has the asked round trip and per-direction bandwidth,
and leaves no namespace or process behind.  Measured by separate processes inside the two
namespaces over real TCP, not read back from our own settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("network_namespaces"),
]

SIZE = 3 << 20  # bytes per bulk transfer

# in ns_b, on 127.0.0.1: per connection, b"p" = echo, b"u" = read to EOF then answer b"k",
# b"d" = send SIZE bytes then close
SERVER = f"""
import socket, threading
def serve(c):
    with c:
        mode = c.recv(1)
        if mode == b"p":
            while d := c.recv(65536): c.sendall(d)
        elif mode == b"u":
            while c.recv(65536): pass
            c.sendall(b"k")
        elif mode == b"d":
            c.sendall(b"x" * {SIZE})
s = socket.create_server(("127.0.0.1", 0))
print(s.getsockname()[1], flush=True)
while True:
    c, _ = s.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""

# in ns_a: median ping RTT, then upload and download rates with one RTT taken off each
CLIENT = f"""
import json, socket, statistics, sys, time
addr = (sys.argv[1], int(sys.argv[2]))
def conn(mode):
    c = socket.create_connection(addr, timeout=20)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return c, mode
c, _ = conn(b"p")
c.sendall(b"p"); rtts = []
for _ in range(60):
    t0 = time.perf_counter(); c.sendall(b"x" * 64); got = 0
    while got < 64: got += len(c.recv(64 - got))
    rtts.append(time.perf_counter() - t0)
c.close()
rtt = statistics.median(rtts[10:])
rtt_min = min(rtts[10:])  # a busy machine only adds to a round trip: the least is the link's own
c, _ = conn(b"u")
t0 = time.perf_counter(); c.sendall(b"u" + b"x" * {SIZE}); c.shutdown(socket.SHUT_WR)
assert c.recv(1) == b"k"
up = {SIZE} * 8 / (time.perf_counter() - t0 - rtt) / 1e6
c.close()
c, _ = conn(b"d")
t0 = time.perf_counter(); c.sendall(b"d"); got = 0
while d := c.recv(65536): got += len(d)
down = got * 8 / (time.perf_counter() - t0 - rtt) / 1e6
assert got == {SIZE}, got
print(json.dumps({{"rtt_ms": rtt * 1e3, "rtt_min_ms": rtt_min * 1e3, "up_mbit": up, "down_mbit": down}}))
"""


@pytest.fixture
def links(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import _links

    return _links


def _proxies_for(addr: str) -> list[int]:
    """Pids of delay-proxy processes listening on ``addr`` (read from /proc, not from our handles)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(arg.endswith(b"_delay.py") for arg in cmdline) and any(arg.startswith(addr.encode() + b":")
                                                                       for arg in cmdline):
            found.append(int(pid))
    return found


def _start_server(link) -> tuple[subprocess.Popen[str], int]:  # type: ignore[no-untyped-def]
    server = link.run(link.ns_b, [sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    return server, int(server.stdout.readline())


def measure(links, runs: int, **shape: float | None) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """The link's figures over ``runs`` client runs: the least round trip, the best rate each way
    (a busy 2-core machine can only add delay and fall short of a rate, never the reverse)."""
    with links.emulated_link(**shape) as link:
        server, port = _start_server(link)
        proxy_port = link.delayed_port(port)
        results = []
        for _ in range(runs):
            client = link.run(link.ns_a, [sys.executable, "-c", CLIENT, link.addr_b, str(proxy_port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            out, err = client.communicate(timeout=60)
            assert client.returncode == 0, err
            results.append(json.loads(out))
    print(shape, results)
    return {"rtt_ms": min(r["rtt_min_ms"] for r in results), "up_mbit": max(r["up_mbit"] for r in results),
            "down_mbit": max(r["down_mbit"] for r in results)}


ASKED = {"rtt_ms": 3.4, "a_to_b_mbit": 89, "b_to_a_mbit": 49}


def test_the_link_has_the_asked_rtt_and_asymmetric_bandwidth_both_ways(links) -> None:  # type: ignore[no-untyped-def]
    """Bounds on both sides, derived rather than guessed. The unshaped link (the control, same
    machine) gives the proxies' own round trip and what the machine can carry. The shaped link's
    least round trip is at least the delay asked (the proxies sleep half of it each way) and at
    most that plus the unshaped round trip plus 1 ms of scheduling (a link that adds 100 ms fails);
    each direction's best rate is at most 1.2 x its cap (token-bucket bursts) and at least half of
    the cap or of what the machine carries, whichever is less (slow start and the one round trip
    taken off). Negative control, run by hand: the same assertions on a link built with
    rtt_ms=103.4 failed on the round trip."""
    bare = measure(links, 1)
    shaped = measure(links, 3, **ASKED)
    print(bare, shaped)
    assert bare["rtt_ms"] < 0.9 * ASKED["rtt_ms"], bare  # the control: no delay added
    assert ASKED["rtt_ms"] * 0.95 <= shaped["rtt_ms"] <= ASKED["rtt_ms"] + bare["rtt_ms"] + 1.0, (bare, shaped)
    for key, cap in (("up_mbit", ASKED["a_to_b_mbit"]), ("down_mbit", ASKED["b_to_a_mbit"])):
        assert 0.5 * min(cap, bare[key]) <= shaped[key] <= 1.2 * cap, (key, bare, shaped)
    assert shaped["up_mbit"] / shaped["down_mbit"] > 1.4, shaped  # each direction at its own rate


class _Boom(Exception):
    pass


@pytest.mark.parametrize("error", [_Boom, KeyboardInterrupt])
def test_cleanup_after_an_exception(links, error: type[BaseException]) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error):
        with links.emulated_link(rtt_ms=1.0, a_to_b_mbit=10, b_to_a_mbit=None) as link:
            server, port = _start_server(link)
            link.delayed_port(port)
            link.delayed_port(port)
            assert {link.ns_a, link.ns_b} <= set(links.namespaces())
            assert len(_proxies_for(link.addr_b)) == 2
            raise error
    assert server.wait(5) is not None
    assert not {link.ns_a, link.ns_b} & set(links.namespaces())
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert link.ns_a not in listed and link.ns_b not in listed
    assert _proxies_for(link.addr_b) == []


def test_stale_namespaces_of_dead_runs_are_swept(links) -> None:  # type: ignore[no-untyped-def]
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no longer runs
    stale = f"{links.PREFIX}-{gone.pid}-abcdef-a"
    subprocess.run(["ip", "netns", "add", stale], check=True, timeout=10)
    try:
        with links.emulated_link():
            assert stale not in links.namespaces()
    finally:
        subprocess.run(["ip", "netns", "delete", stale], capture_output=True, timeout=10)
