"""``moeswarm demo``: a whole swarm on loopback, as separate processes, on one checkpoint.

Starts a bootstrap expert node and more expert nodes that split the experts between them,
waits for each one's ``READY`` line, runs a backbone in this process that reads no expert
weights, generates a completion through the swarm, prints which peer served which experts,
and stops every process it started.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import IO, Any

from ..errors import ConfigError, Timeout


@dataclass
class Daemon:
    name: str
    process: subprocess.Popen[str]
    info: dict[str, Any]
    log: IO[str]  # the process's stderr, in a temporary file
    lines: list[str] = field(default_factory=list)  # its stdout lines so far (READY, REBALANCE ...), read live

    def log_tail(self, chars: int = 2000) -> str:
        self.log.flush()
        with open(self.log.name, errors="replace") as fh:
            return fh.read()[-chars:]


def _wait_ready(name: str, process: subprocess.Popen[str], timeout_s: float, log: IO[str],
                lines: list[str]) -> dict[str, Any]:
    """Read the process's stdout until its READY line (in a thread, so the wait is bounded); the
    thread goes on appending every line to ``lines``."""
    found: dict[str, Any] = {}
    done = threading.Event()

    def reader(stream: IO[str]) -> None:
        try:
            for line in stream:  # keeps draining stdout so the daemon never blocks on a full pipe
                lines.append(line.rstrip("\n"))
                if line.startswith("READY ") and not found:
                    found.update(json.loads(line[6:]))
                    done.set()
        except (ValueError, OSError):  # closed by stop_daemon
            pass
        finally:
            done.set()

    threading.Thread(target=reader, args=(process.stdout,), daemon=True).start()
    if not done.wait(timeout_s) or not found:
        process.kill()
        process.wait(5)
        log.flush()
        with open(log.name, errors="replace") as fh:
            tail = fh.read()[-800:]
        raise Timeout(f"{name} did not print READY within {timeout_s:.0f}s; its stderr ends: {tail}")
    return found


def start_daemon(name: str, args: list[str], timeout_s: float = 120.0, env: dict[str, str] | None = None) -> Daemon:
    """Start ``moeswarm ARGS`` and wait for its READY line; stderr goes to a temporary file."""
    return start_daemons([(name, args)], timeout_s, env)[0]


def start_daemons(commands: Sequence[tuple[str, list[str]]], timeout_s: float = 120.0,
                  env: dict[str, str] | None = None) -> list[Daemon]:
    """Start every ``(name, moeswarm ARGS)`` at once, then wait for each one's READY line (so their
    start-ups overlap); if one fails, the others are stopped."""
    spawned: list[tuple[str, subprocess.Popen[str], IO[str]]] = []
    ready: list[Daemon] = []
    try:
        for name, args in commands:
            log = tempfile.NamedTemporaryFile("w+", prefix=f"moeswarm-{name.replace(' ', '-')}-", suffix=".log")
            try:
                process = subprocess.Popen(
                    [sys.executable, "-m", "moeswarm.cli", *args], stdout=subprocess.PIPE, stderr=log, text=True,
                    env={**os.environ, "OPENBLAS_NUM_THREADS": "1", **(env or {})},
                )
            except BaseException:
                log.close()
                raise
            spawned.append((name, process, log))
        for name, process, log in spawned:
            lines: list[str] = []
            ready.append(Daemon(name, process, _wait_ready(name, process, timeout_s, log, lines), log, lines))
        return ready
    except BaseException:
        for name, process, log in spawned[len(ready):]:
            if process.poll() is None:
                process.kill()
                process.wait(5)
            if process.stdout is not None:
                process.stdout.close()
            log.close()
        stop_daemons(ready)
        raise


def stop_daemon(daemon: Daemon, timeout_s: float = 15.0) -> None:
    """SIGTERM (clean shutdown: the node withdraws its announcement), SIGKILL if it hangs."""
    stop_daemons([daemon], timeout_s)


def stop_daemons(daemons: Sequence[Daemon], timeout_s: float = 15.0) -> None:
    """``stop_daemon`` for several at once: every one is sent SIGTERM first, so their clean
    shutdowns overlap; each gets ``timeout_s`` from then before SIGKILL."""
    for daemon in daemons:
        if daemon.process.poll() is None:
            daemon.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for daemon in daemons:
        try:
            daemon.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            daemon.process.kill()
            daemon.process.wait(5)
        if daemon.process.stdout is not None:
            daemon.process.stdout.close()
        daemon.log.close()


@contextmanager
def expert_nodes(model_dir: str, ranges: Sequence[str], *, bootstrap: str | None = None,
                 extra_args: Callable[[int], list[str]] = lambda i: [],
                 progress: Callable[[str], None] = lambda line: None) -> Iterator[list[Daemon]]:
    """One ``moeswarm node`` per range of experts ("0-3"); they join through ``bootstrap``, else
    through the first node, which is then started (and READY) before the others.  The others start
    at once, except ``--experts auto`` nodes, each started once the one before is READY (each
    chooses from what the others announced).  Stopped together on exit.  ``extra_args(i)`` adds
    options to node ``i``'s command line; ``progress`` hears a line as each one starts."""
    started: list[Daemon] = []
    try:
        i = 0
        while i < len(ranges):
            boot = bootstrap or (started[0].info["multiaddrs"][0] if started else None)
            # a batch: the bootstrap node alone, an auto node alone, else every fixed range left before the next auto
            end = i + 1
            if boot is not None and ranges[i] != "auto":
                while end < len(ranges) and ranges[end] != "auto":
                    end += 1
            batch = []
            for j in range(i, end):
                progress(f"  starting node {j} (experts {ranges[j]} of every layer)"
                         + (" as the bootstrap peer..." if boot is None else "..."))
                args = ["node", "--model", model_dir, "--experts", ranges[j], *extra_args(j)]
                batch.append((f"node {j}", args + (["--bootstrap", boot] if boot else [])))
            started += start_daemons(batch)
            i = end
        yield started
    finally:
        stop_daemons(started[::-1])


@contextmanager
def local_swarm(model_dir: str, nodes: int, *, experts_per_layer: int,
                progress: Callable[[str], None] = lambda line: None) -> Iterator[list[Daemon]]:
    """``nodes`` expert processes splitting the experts evenly; the first is the bootstrap peer."""
    if not 1 <= nodes <= experts_per_layer:
        raise ConfigError(f"nodes must be between 1 and {experts_per_layer}")
    bounds = [round(i * experts_per_layer / nodes) for i in range(nodes + 1)]
    ranges = [f"{bounds[i]}-{bounds[i + 1] - 1}" for i in range(nodes)]
    with expert_nodes(model_dir, ranges, progress=progress) as started:
        yield started


def run_demo(model_dir: str, prompt: str, nodes: int, max_new_tokens: int, monitor: str | None = None,
             keep_s: float = 0.0) -> None:
    """``moeswarm demo``; with ``monitor`` (HOST:PORT) the swarm map runs beside it (its own process),
    and ``keep_s`` keeps the swarm and the map up that long after generating, for a person to look."""
    import asyncio

    import click

    from .._cli_util import echo_prompt, served_summary, stream
    from ..daemon import SwarmConfig, span
    from ..model import SamplingParams, generate, load_config
    from ..node.backbone import SwarmBackbone
    from ..node.config import BackboneConfig
    from ..protocol import peer_id_to_str

    cfg = load_config(model_dir)
    t0 = time.monotonic()
    click.echo(f"starting a swarm on loopback: {nodes} expert node processes splitting the "
               f"{cfg.num_experts} experts of each layer, then a backbone in this process (attention, routers, "
               "LM head; it reads no expert weights)...", err=True)
    with local_swarm(model_dir, nodes, experts_per_layer=cfg.num_experts,
                     progress=lambda line: click.echo(line, err=True)) as daemons:
        click.echo(f"started {len(daemons)} expert nodes in {time.monotonic() - t0:.1f}s:", err=True)
        for d in daemons:
            click.echo(f"  {d.name}: peer ...{d.info['peer_id'][-12:]} experts {span(d.info['experts'])} "
                       f"at {d.info['endpoint']}", err=True)
        bootstrap = (daemons[0].info["multiaddrs"][0],)
        watcher = None
        if monitor is not None:
            watcher = start_daemon("monitor", ["monitor", "--bootstrap", bootstrap[0], "--model", model_dir,
                                               "--http", monitor, "--interval", "2"])
            click.echo(f"swarm map: {watcher.info['http']}/", err=True)

        async def generate_through_swarm() -> dict[bytes, set[tuple[int, int]]]:
            config = BackboneConfig(SwarmConfig(model_dir, bootstrap=bootstrap, client_mode=True))
            click.echo("starting the backbone...", err=True)
            async with SwarmBackbone(config) as backbone:
                assert backbone.model is not None and backbone.executor is not None
                tokenizer = backbone.tokenizer()
                ids = tokenizer.encode(prompt)
                text = tokenizer.stream(ids)
                echo_prompt(tokenizer.decode(ids))
                params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=cfg.eos_token_ids)
                await asyncio.to_thread(stream, generate(backbone.model, ids, params), text.feed)
                return backbone.executor.served_by

        served_by = asyncio.run(generate_through_swarm())
        names = {d.info["peer_id"]: d.name for d in daemons}
        click.echo("which node served which experts:", err=True)
        for peer, pairs in sorted(served_by.items(), key=lambda kv: names.get(peer_id_to_str(kv[0]), "")):
            click.echo(f"  {names.get(peer_id_to_str(peer), peer_id_to_str(peer))}: {served_summary(pairs)}",
                       err=True)
        if keep_s > 0:
            click.echo(f"keeping the swarm up for {keep_s:.0f} s (Ctrl-C stops it)", err=True)
            with contextlib.suppress(KeyboardInterrupt):
                time.sleep(keep_s)
        if watcher is not None:
            stop_daemon(watcher)
    click.echo("all nodes stopped", err=True)
