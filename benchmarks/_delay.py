"""A TCP proxy that delays each direction by a fixed time (and can cap its bandwidth):
userspace link emulation, since this kernel has no netem qdisc.

Each direction of each connection has a reader thread, which timestamps every chunk as it
arrives, and a writer thread, which sleeps until the chunk is due (``time.sleep`` is
``clock_nanosleep``: tens of microseconds late, where an asyncio timer rounds up to whole
milliseconds) and writes it.  Bytes keep their order; a chunk read at t is written at
t + delay, or later when the bandwidth cap says so (store and forward: the whole chunk must
have crossed the capped link before its delay starts).  TCP_NODELAY on both sockets.

Run it in its own process for precise timing (no other Python thread holding the GIL):

    python benchmarks/_delay.py --listen 127.0.0.1:0 --target 127.0.0.1:9000 --delay-ms 1.7
    ip netns exec NS python benchmarks/_delay.py --listen 10.77.0.2:0 --target 127.0.0.1:9000 --delay-ms 1.7

It prints ``READY host:port`` once listening and runs until SIGTERM / SIGINT (or, with
``--watch-stdin``, until its stdin closes: the parent died).  ``spawn_delay_proxy`` does this
from Python.  ``--measure`` compares a small TCP ping-pong with and without the proxy.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence

CHUNK = 1 << 16  # bytes per read
MAX_BUFFERED = 4 << 20  # bytes queued per direction before the reader stops reading (backpressure)
_PR_SET_TIMERSLACK = 29


def _tight_timer_slack() -> None:
    """Ask Linux to wake this thread's sleeps on time (the default slack is 50 us); best effort."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _nodelay(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class _Direction:
    """src -> dst for one connection: ``reader`` queues (due time, chunk), ``writer`` sends on time."""

    def __init__(self, src: socket.socket, dst: socket.socket, delay_s: float, bytes_per_s: float | None,
                 abort: threading.Event) -> None:
        self.src, self.dst, self.delay_s, self.bytes_per_s = src, dst, delay_s, bytes_per_s
        self.abort = abort  # set when either direction breaks: then the whole connection unwinds
        self.queue: deque[tuple[float, bytes | None]] = deque()  # None = the source closed (EOF)
        self.buffered = 0
        self.cond = threading.Condition()
        self.link_free = 0.0  # when the capped link finishes sending what is queued so far

    def reader(self) -> None:
        try:
            while chunk := self.src.recv(CHUNK):
                now = time.monotonic()
                with self.cond:
                    while self.buffered > MAX_BUFFERED and not self.abort.is_set():
                        self.cond.wait(0.5)
                    self._push(now, chunk)
        except OSError:
            self._fail()
        with self.cond:
            self.queue.append((0.0, None))
            self.cond.notify_all()

    def _push(self, now: float, chunk: bytes) -> None:
        due = now + self.delay_s
        if self.bytes_per_s:
            self.link_free = max(self.link_free, now) + len(chunk) / self.bytes_per_s
            due = self.link_free + self.delay_s
        self.queue.append((due, chunk))
        self.buffered += len(chunk)
        self.cond.notify_all()

    def writer(self) -> None:
        _tight_timer_slack()
        try:
            while not self.abort.is_set():
                with self.cond:
                    while not self.queue:
                        self.cond.wait()
                    due, chunk = self.queue.popleft()
                    self.buffered -= len(chunk or b"")
                    self.cond.notify_all()
                if chunk is None:
                    self.dst.shutdown(socket.SHUT_WR)  # pass the EOF on: a half-close, as TCP does
                    return
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                self.dst.sendall(chunk)
        except OSError:
            self._fail()

    def _fail(self) -> None:
        """A reset or a write error: end both directions now (shutdown wakes their blocked reads)."""
        self.abort.set()
        for sock in (self.src, self.dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with self.cond:
            self.cond.notify_all()


class DelayProxy:
    """Forward ``listen`` -> ``target`` with ``delay_s`` each way, in this process's threads.

    Every thread is a daemon and ``close`` ends them all; another busy Python thread in the same
    process delays the wake-ups (the GIL), so use ``spawn_delay_proxy`` when precision matters."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int], delay_s: float,
                 bytes_per_s: float | None = None) -> None:
        self.target, self.delay_s, self.bytes_per_s = target, delay_s, bytes_per_s
        self._listener = socket.create_server(listen, backlog=64)
        self.host, self.port = self._listener.getsockname()[:2]
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._closed = False
        self._accept_thread = threading.Thread(target=self._accept, name="delay-accept", daemon=True)
        self._accept_thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._connection, args=(client,), daemon=True).start()

    def _connection(self, client: socket.socket) -> None:
        try:
            server = socket.create_connection(self.target, timeout=5)
            server.settimeout(None)
        except OSError:
            client.close()
            return
        pair = (_nodelay(client), _nodelay(server))
        with self._lock:
            if not self._closed:
                self._sockets.update(pair)
        if self._closed:
            _close(pair)
            return
        abort = threading.Event()
        threads = []
        for src, dst in (pair, pair[::-1]):
            d = _Direction(src, dst, self.delay_s, self.bytes_per_s, abort)
            threads += [threading.Thread(target=d.reader, daemon=True), threading.Thread(target=d.writer, daemon=True)]
        for t in threads:
            t.start()
        for t in threads[1::2]:  # the writers end last: at both EOFs, or at the first error
            t.join()
        with self._lock:
            self._sockets.difference_update(pair)
        _close(pair)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets, self._sockets = list(self._sockets), set()
        _close([self._listener, *sockets])
        self._accept_thread.join(5)

    def __enter__(self) -> DelayProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close(sockets: Sequence[socket.socket]) -> None:
    for sock in sockets:
        try:
            sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in accept / recv on it
        except OSError:
            pass
        sock.close()


def start_delay_proxy(listen_port: int, target_port: int, delay_s: float,
                      bytes_per_s: float | None = None) -> DelayProxy:
    """Forward 127.0.0.1:listen_port -> 127.0.0.1:target_port with ``delay_s`` each way (in-process)."""
    return DelayProxy(("127.0.0.1", listen_port), ("127.0.0.1", target_port), delay_s, bytes_per_s)


class ProxyProcess:
    """A delay proxy in its own process (see ``spawn_delay_proxy``)."""

    def __init__(self, process: subprocess.Popen[str], host: str, port: int) -> None:
        self.process, self.host, self.port = process, host, port

    def close(self, timeout_s: float = 5.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout_s)
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()

    def __enter__(self) -> ProxyProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def spawn_delay_proxy(listen: str, target: str, delay_s: float, bytes_per_s: float | None = None,
                      prefix: Sequence[str] = (), timeout_s: float = 10.0) -> ProxyProcess:
    """Run this file as a proxy process ``listen`` (HOST:PORT, port 0 = any) -> ``target`` and wait
    for its READY line.  ``prefix`` goes before the command, e.g. ``["ip", "netns", "exec", NS]``.
    The proxy exits when its stdin closes, so it does not outlive this process."""
    argv = [*prefix, sys.executable, os.path.abspath(__file__), "--listen", listen, "--target", target,
            "--delay-ms", repr(delay_s * 1e3), "--watch-stdin"]
    if bytes_per_s:
        argv += ["--mbit", repr(bytes_per_s * 8 / 1e6)]
    process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    timer = threading.Timer(timeout_s, process.kill)  # bounds the readline below
    timer.start()
    try:
        line = process.stdout.readline()
    finally:
        timer.cancel()
    if not line.startswith("READY "):
        ProxyProcess(process, "", 0).close()
        raise RuntimeError(f"delay proxy {' '.join(argv)} did not start (exit code {process.poll()})")
    host, port = line.split()[1].rsplit(":", 1)
    return ProxyProcess(process, host, int(port))


def _hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


def _serve(args: argparse.Namespace) -> None:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if args.watch_stdin:

        def watch() -> None:
            sys.stdin.read()  # returns at EOF: the parent closed the pipe or died
            stop.set()

        threading.Thread(target=watch, daemon=True).start()
    bytes_per_s = args.mbit * 1e6 / 8 if args.mbit else None
    with DelayProxy(_hostport(args.listen), _hostport(args.target), args.delay_ms / 1e3, bytes_per_s) as proxy:
        print(f"READY {proxy.host}:{proxy.port}", flush=True)
        while not stop.wait(1.0):
            pass


# ---------------------------------------------------------------- --measure


def _echo_server() -> tuple[socket.socket, int]:
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with _nodelay(conn):
            while data := conn.recv(CHUNK):
                conn.sendall(data)

    def accept_loop() -> None:
        for _ in range(2):  # one direct connection, one through the proxy
            serve()

    threading.Thread(target=accept_loop, daemon=True).start()
    return listener, listener.getsockname()[1]


def ping_rtts(port: int, n: int, size: int = 64, host: str = "127.0.0.1") -> list[float]:
    """Round-trip times (s) of ``n`` ``size``-byte ping-pongs on one TCP connection to an echo server."""
    samples = []
    with _nodelay(socket.create_connection((host, port), timeout=5)) as sock:
        payload = b"x" * size
        for _ in range(n):
            t0 = time.perf_counter()
            sock.sendall(payload)
            got = 0
            while got < size:
                chunk = sock.recv(size - got)
                if not chunk:
                    raise ConnectionError("echo server closed the connection")
                got += len(chunk)
            samples.append(time.perf_counter() - t0)
    return samples


def measure_rtts(delay_s: float, n: int) -> tuple[list[float], list[float]]:
    """Ping RTTs (s) to a loopback echo server, direct and through a proxy process delaying ``delay_s`` each way."""
    listener, port = _echo_server()
    try:
        direct = ping_rtts(port, n)
        with spawn_delay_proxy("127.0.0.1:0", f"127.0.0.1:{port}", delay_s) as proxy:
            proxied = ping_rtts(proxy.port, n)
    finally:
        listener.close()
    return direct, proxied


def _measure(delay_ms: float, n: int) -> None:
    direct, proxied = measure_rtts(delay_ms / 1e3, n)
    med = statistics.median

    def q(xs: list[float], p: float) -> float:
        return sorted(xs)[int(p * (len(xs) - 1))] * 1e3

    print(f"\n64-byte TCP ping-pong on loopback, {n} round trips each, asked {delay_ms} ms each way")
    print("| path | median RTT | p10 | p90 | one-way delay delivered (median) |")
    print("|---|---|---|---|---|")
    print(f"| direct | {med(direct) * 1e3:.3f} ms | {q(direct, .1):.3f} | {q(direct, .9):.3f} | |")
    print(f"| through the proxy | {med(proxied) * 1e3:.3f} ms | {q(proxied, .1):.3f} | {q(proxied, .9):.3f} | "
          f"{(med(proxied) - med(direct)) / 2 * 1e3:.3f} ms (asked {delay_ms} ms) |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT", help="listen here (port 0 = any free)")
    ap.add_argument("--target", metavar="HOST:PORT", help="forward to here")
    ap.add_argument("--delay-ms", type=float, default=1.7, help="added delay in each direction, milliseconds")
    ap.add_argument("--mbit", type=float, default=None, help="bandwidth cap per direction, Mbit/s (default none)")
    ap.add_argument("--watch-stdin", action="store_true", help="exit when stdin closes (the parent died)")
    ap.add_argument("--measure", action="store_true", help="print ping RTT direct vs through a proxy, then exit")
    ap.add_argument("--pings", type=int, default=500, help="round trips per path for --measure")
    args = ap.parse_args()
    if args.measure:
        _measure(args.delay_ms, args.pings)
    elif args.target is None:
        ap.error("--target is required (or --measure)")
    else:
        _serve(args)


if __name__ == "__main__":
    main()
