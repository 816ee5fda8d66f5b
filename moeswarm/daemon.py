"""Process plumbing every moeswarm daemon shares (node, backbone, relay, bridge, monitor): range
parsing, identity files, the ``READY {json}`` line, SIGINT/SIGTERM, and joining the control plane.

Importing this module loads neither libp2p nor trio: ``p2p_node`` imports them when a daemon
actually joins the DHT.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from ._keys import load_key_file
from .errors import ConfigError
from .protocol import Identity


def parse_range(text: str | None, upper: int, what: str) -> tuple[int, int]:
    """``"A-B"`` (inclusive, as a person writes it) or ``"A"``; ``None`` means all of ``0..upper-1``."""
    if text is None or text == "all":
        return 0, upper - 1
    try:
        a, _, b = text.partition("-")
        first, last = int(a), int(b) if b else int(a)
    except ValueError:
        raise ConfigError(f"--{what} takes an inclusive range like 0-31, not {text!r}") from None
    if first > last:
        raise ConfigError(f"--{what} {text} is reversed: write the lower end first, {last}-{first}")
    if not 0 <= first <= last < upper:
        raise ConfigError(f"--{what} {text} is outside 0-{upper - 1}")
    return first, last


def span(bounds: Any) -> str:
    """An inclusive range as a person writes it (and as ``parse_range`` reads it): ``0-2``, or ``5``."""
    first, last = bounds
    return str(first) if first == last else f"{first}-{last}"


def say(text: str) -> None:
    """A line for the person who started the daemon (stderr: stdout carries the READY line)."""
    print(text, file=sys.stderr, flush=True)


def check_listen(host: str, port: int, option: str) -> None:
    """``ConfigError`` at once, before loading or dialling anything, if ``host:port`` cannot be
    listened on (another process holds it, or it needs privileges); port 0 always can."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do: TIME_WAIT is no obstacle
        try:
            probe.bind((host.strip("[]"), port))
        except OSError as e:
            raise ConfigError(f"{option} {host}:{port}: {listen_problem(e)}") from None


def listen_problem(e: OSError) -> str:
    """Why a bind failed, in words (not asyncio's ``[Errno 98] error while attempting to bind ...``)."""
    if e.errno == errno.EADDRINUSE:
        return "the port is in use by another process (choose another port, or 0 for any free one)"
    if e.errno == errno.EACCES:
        return "permission denied (ports below 1024 need root or CAP_NET_BIND_SERVICE)"
    if e.errno == errno.EADDRNOTAVAIL:
        return "no network interface of this machine has that address"
    return e.strerror or str(e)


def load_identity(path: str | None) -> Identity:
    """The node's Ed25519 key from ``path`` (created, mode 0600, if missing), or a fresh one."""
    return Identity.generate() if path is None else load_key_file(path, create=True, what="identity file")


def public_multiaddrs(multiaddrs: list[str], cfg: "SwarmConfig") -> list[str]:
    """Listen addresses as others should dial them (``--announce-host`` replaces the bound host)."""
    if not cfg.announce_host:
        return list(multiaddrs)
    return [m.replace(f"/ip4/{cfg.host}/", f"/ip4/{cfg.announce_host}/", 1) for m in multiaddrs]


_serving = False  # set by ready(): from then on, a signal drains the daemon instead of cancelling it

DRAIN_GRACE_S: Final = 6.0
"""After SIGINT/SIGTERM a serving daemon has this long to drain (withdraw its announcement, let
answers in flight finish) before it is cancelled; a second signal cancels it at once."""


def ready(info: dict[str, Any]) -> None:
    global _serving
    _serving = True
    sys.stdout.write("READY " + json.dumps(info, sort_keys=True) + "\n")
    sys.stdout.flush()


@dataclass(frozen=True)
class SwarmConfig:
    """What every swarm process shares: where the model is and how to reach the DHT."""

    model_dir: str
    bootstrap: tuple[str, ...] = ()  # multiaddrs with /p2p/<peer id>; none = this is a bootstrap peer
    host: str = "127.0.0.1"  # address to listen on (libp2p and data plane)
    announce_host: str | None = None  # address others should dial, if not ``host``
    p2p_port: int = 0  # 0 picks a free port
    client_mode: bool = False  # behind NAT: DHT client mode
    model_id: str | None = None  # default: derived from the checkpoint (model_id_for)
    identity_file: str | None = None


def joining(cfg: SwarmConfig) -> str:
    """The line a daemon prints before it dials (or, as the first peer, starts) the swarm."""
    if not cfg.bootstrap:
        return "starting a new swarm: this process is its bootstrap peer (others join with --bootstrap)..."
    return f"joining the swarm through {', '.join(cfg.bootstrap)}..."


@contextlib.asynccontextmanager
async def p2p_node(identity: Identity, cfg: SwarmConfig) -> AsyncIterator[Any]:
    from .net.p2p import (  # imports libp2p (1-2 s): only when a daemon starts
        P2PConfig,
        P2PNode,
    )

    node = P2PNode(identity, P2PConfig(listen=f"/ip4/{cfg.host}/tcp/{cfg.p2p_port}", bootstrap=cfg.bootstrap,
                                       client_mode=cfg.client_mode))
    await node.start()
    try:
        yield node
    finally:
        await node.stop()


def stop_event(grace_s: float = DRAIN_GRACE_S) -> asyncio.Event:
    """An event SIGINT and SIGTERM set, for a daemon run by ``run_daemon``.

    The daemon drains when it sees the event; until it has printed READY (loading, dialling a
    bootstrap peer, waiting for a relay) there is nothing to drain and the calling task is
    cancelled at once; once serving, it is cancelled if draining outlasts ``grace_s``, or on a
    second signal.  So a signal stops the process within seconds in every state."""
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()

    def on_signal(name: str) -> None:
        if main is None or main.done():
            event.set()
            return
        if event.is_set() or not _serving:
            say(f"{name}: stopping")
            event.set()
            main.cancel()
            return
        say(f"{name}: draining... (again to stop at once)")
        event.set()
        loop.call_later(grace_s, main.cancel)

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, on_signal, sig.name)
    return event


def run_daemon(main: Coroutine[Any, Any, None]) -> None:
    """``asyncio.run(main)`` for a daemon whose coroutine calls ``stop_event()``: a stop by signal
    (a cancelled main task) ends in a "stopped" line and exit status 0, not a traceback."""
    try:
        asyncio.run(main)
    except asyncio.CancelledError:
        pass
    say("stopped")


# ---------------------------------------------------------------- run files: the daemons running here
# Each daemon serving ``/status`` leaves a run file in ``$MOESWARM_HOME/run`` (default
# ``~/.moeswarm/run``) naming that URL and its PID, removed when it stops; ``moeswarm node status``
# and the monitor find the daemons of this machine through them.


def run_dir() -> Path:
    return Path(os.environ.get("MOESWARM_HOME") or Path.home() / ".moeswarm") / "run"


@contextlib.contextmanager
def run_file(role: str, peer_id: str, url: str) -> Iterator[Path]:
    """Leave ``{role, peer_id, status, pid}`` in the run folder while the block runs."""
    folder = run_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{role}-{peer_id}.json"
    path.write_text(json.dumps({"role": role, "peer_id": peer_id, "status": url, "pid": os.getpid()}))
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def running() -> list[dict[str, Any]]:
    """Run files of processes still alive (stale files of crashed ones are removed)."""
    out = []
    folder = run_dir()
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            info = json.loads(path.read_text())
            pid = int(info["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if _alive(pid):
            out.append(info)
        else:
            path.unlink(missing_ok=True)
    return out


def fetch_reports(urls: list[str], timeout: float = 5.0) -> list[dict[str, Any]]:
    """``GET /status`` of each URL (default: every daemon running here); failures become
    ``{"url", "error"}`` entries rather than exceptions."""
    import urllib.error
    import urllib.request

    targets = urls or [info["status"] for info in running()]
    out = []
    for url in targets:
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/status", timeout=timeout) as response:
                report = json.loads(response.read())
            report["url"] = url
        except urllib.error.HTTPError as e:
            e.close()  # it holds the open response
            report = {"url": url, "error": f"HTTP {e.code}: {e.reason}"}
        except (urllib.error.URLError, OSError, ValueError) as e:
            report = {"url": url, "error": str(getattr(e, "reason", e))}
        out.append(report)
    return out
