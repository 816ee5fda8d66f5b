"""Hundreds of real libp2p peers on this machine, several to a process (tests and benchmarks).

    async with PeerSwarm(holders=200, per_process=50) as swarm:
        backbone = await swarm.backbone()          # a P2PNode + Discovery in this process
        await swarm.withdraw(7); await swarm.move(9, experts=(9, 10))

Each holder is a ``P2PNode`` (real TCP, Noise, Yamux, the project's DHT and GossipSub) running
the project's ``Announcer`` for one model of ``layers`` MoE layers; holder ``i`` serves expert
``i`` of every layer, so full coverage of the model's ``holders`` experts means every holder's
record was seen. Holders announce on the model's topic only (``AnnounceConfig.dht=False``; with
``dht=True`` each also stores its record under its layers' DHT keys, as a node does by default:
that write, and the lookup of itself that fills a node's routing table at start, are each
holder's own cost, 1-2 s of CPU per holder at start-up here, and no backbone reads the record
when the topic answers; without ``dht`` holders skip both, ``P2PConfig.bootstrap_lookup=False``).
Every holder here connects from 127.0.0.1, one address, so the holders' budget of new keys per
forwarding address (``GossipLimits``, meant for one machine) is raised to the swarm's size; the
backbones keep the defaults.
Worker processes (``python tests/peer_swarm.py``) start their share of holders (a ``seeds`` line
once their first three holders run, on which the coordinator starts the next workers; ``ready``
once all run) and answer JSON commands on stdin, one line each: ``withdraw``, ``move``, ``stats``
(resident memory, CPU seconds, bytes read from libp2p connections, counted in RawConnection.read: every
control-plane byte, DHT and gossip; GossipSub control messages handled, routers whose heartbeat
has not run for 5 s, topic messages the holders' gates refused, by reason), ``refresh`` (holders
publish once more), ``peers`` (one holder's connections and topic peers), ``profile`` (where the
process's threads are, sampled), ``stop``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MODEL = "swarm/peers"
ENDPOINT = "tcp+tls://127.0.0.1:9"  # nobody calls it: discovery is what is measured


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# ---------------------------------------------------------------- worker process


class _Counter:
    bytes_in = 0


def _count_bytes() -> None:
    """Count every byte this process reads from a libp2p TCP connection (instrumentation)."""
    from libp2p.network.connection.raw_connection import RawConnection

    read = RawConnection.read

    async def counted(self: Any, n: int | None = None) -> bytes:
        data = await read(self, n)
        _Counter.bytes_in += len(data)
        return data

    RawConnection.read = counted  # type: ignore[method-assign]


_CONTROL: dict[str, int] = {}  # GossipSub control messages and RPCs handled in this process, by kind
_LAST_HEARTBEAT: dict[int, float] = {}  # router -> when its heartbeat last ran


def _count_control() -> None:
    """Count the GossipSub control messages (GRAFT, PRUNE, IHAVE, IWANT) and RPCs this process's
    routers handle, and their heartbeats (instrumentation: what an idle swarm spends its CPU on)."""
    from libp2p.pubsub.gossipsub import GossipSub

    def counting(name: str) -> None:
        original = getattr(GossipSub, name)

        async def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
            _CONTROL[name] = _CONTROL.get(name, 0) + 1
            return await original(self, *args, **kwargs)

        setattr(GossipSub, name, counted)

    for name in ("handle_rpc", "handle_graft", "handle_prune", "handle_ihave", "handle_iwant", "emit_control_message"):
        counting(name)
    mesh_heartbeat = GossipSub.mesh_heartbeat

    def heartbeat(self: Any) -> Any:
        _CONTROL["heartbeat"] = _CONTROL.get("heartbeat", 0) + 1
        _LAST_HEARTBEAT[id(self)] = time.monotonic()
        return mesh_heartbeat(self)

    GossipSub.mesh_heartbeat = heartbeat  # type: ignore[method-assign]


def _profile(seconds: float, interval_s: float = 0.005, top: int = 30) -> dict[str, Any]:
    """Where this process's threads are, sampled every ``interval_s`` for ``seconds``: the share
    of samples per innermost Python function (``self``) and per function anywhere on the stack
    (``total``), leaving out threads idle in trio's epoll wait or in a queue/lock wait."""
    import collections
    import threading

    me = threading.get_ident()
    idle_leaves = {"get_events", "wait", "select", "_wait_for_tstate_lock", "readline", "_worker"}
    own: collections.Counter[str] = collections.Counter()
    anywhere: collections.Counter[str] = collections.Counter()
    busy = samples = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for ident, frame in sys._current_frames().items():
            if ident == me or frame.f_code.co_name in idle_leaves:
                continue
            busy += 1
            own[f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}"] += 1
            seen = set()
            f: Any = frame
            while f is not None:
                name = f"{Path(f.f_code.co_filename).name}:{f.f_code.co_name}"
                if name not in seen:
                    seen.add(name)
                    anywhere[name] += 1
                f = f.f_back
        samples += 1
        time.sleep(interval_s)

    def share(counter: collections.Counter[str]) -> list[tuple[str, float]]:
        return [(k, round(v / max(busy, 1), 3)) for k, v in counter.most_common(top)]

    return {"samples": samples, "busy_thread_samples": busy, "self": share(own), "total": share(anywhere)}


async def _worker(args: argparse.Namespace) -> None:
    from dataclasses import replace

    from moeswarm.errors import SwarmError
    from moeswarm.net.announce import AnnounceConfig, Announcer
    from moeswarm.net.gossip_view import TopicGate
    from moeswarm.net.p2p import P2PConfig, P2PNode
    from moeswarm.protocol import Identity

    _count_bytes()
    _count_control()
    moe = tuple(range(args.layers))
    nodes: list[P2PNode] = []
    announcers: dict[int, Announcer] = {}
    seeds = tuple(args.bootstrap)
    gate = asyncio.Semaphore(args.concurrency)
    rng = random.Random(args.first)

    async def start(i: int) -> None:
        try:
            await start_once(i)
        except SwarmError as e:  # its bootstrap peers were busy (a loaded machine): once more, on the seeds
            print(f"holder {i}: {e}; again on the seeds", file=sys.stderr, flush=True)
            await start_once(i, seeds)

    async def start_once(i: int, boot: tuple[str, ...] | None = None) -> None:
        async with gate:
            # two local peers; the first two the seed node and the three holders of an earlier
            # worker the coordinator gave (one topic). Never those holders for everyone: once a holder has max_connections,
            # a dial to it hangs until dial_timeout_s (60 s a start, seen with 1 in 4 holders doing so);
            # nor the seed node (a connection, handshake and pubsub stream each, to a node not on the topic)
            local = [n.multiaddrs[0] for n in nodes if n.multiaddrs]
            if boot is None:
                boot = seeds if len(local) < 2 else tuple(rng.sample(local, 2))
            node = P2PNode(Identity.generate(), P2PConfig(bootstrap=boot, max_connections=args.max_connections,
                                                          dial_timeout_s=60.0, op_timeout_s=60.0,
                                                          bootstrap_lookup=args.dht))
            await node.start()
            nodes.append(node)
            announcer = Announcer(node, node._identity, AnnounceConfig(
                MODEL, (0, args.layers - 1), moe, (i, i), (ENDPOINT,), 1 << 20, ttl_s=args.ttl, dht=args.dht))
            if announcer.gossip is not None and args.new_keys_burst:  # every holder here is 127.0.0.1: one
                # address whose budget of new keys (meant for one machine) the whole swarm would share
                limits = replace(announcer.gossip.limits, new_keys_per_address_burst=args.new_keys_burst)
                announcer.gossip.limits = limits
                announcer.gossip.gate = TopicGate(MODEL, limits)
            await announcer.start()
            announcers[i] = announcer

    try:
        first_three = range(args.first, args.first + min(3, args.count))
        await asyncio.gather(*(start(i) for i in first_three))
        # the coordinator starts the other workers on these: they need not wait for all 50
        print(json.dumps({"seeds": [n.multiaddrs[0] for n in nodes]}), flush=True)
        await asyncio.gather(*(start(i) for i in range(first_three.stop, args.first + args.count)))
        print(json.dumps({"ready": sorted(announcers), "multiaddrs": [n.multiaddrs[0] for n in nodes[:4]],
                          "rss_kib": _rss_kib(), "cpu_s": _cpu_s()}), flush=True)
        while line := (await asyncio.to_thread(sys.stdin.readline)).strip():
            cmd = json.loads(line)
            if cmd["op"] == "withdraw":
                await announcers.pop(cmd["holder"]).withdraw()
                reply: dict[str, Any] = {"ok": True}
            elif cmd["op"] == "move":
                experts = tuple(cmd["experts"])
                await announcers[cmd["holder"]].move([((0, args.layers - 1), experts)], moe, 1 << 20)
                reply = {"ok": True}
            elif cmd["op"] == "stats":
                reply = {"rss_kib": _rss_kib(), "cpu_s": _cpu_s(), "bytes_in": _Counter.bytes_in,
                         "nodes": len(nodes), "messages": _messages(announcers), "refused": _refused(announcers),
                         "control": dict(_CONTROL),
                         "stalled_heartbeats": sum(time.monotonic() - t > 5 for t in _LAST_HEARTBEAT.values()),
                         "routers": len(_LAST_HEARTBEAT)}
            elif cmd["op"] == "refresh":  # "count" holders publish their record again, spread over "seconds"
                chosen = list(announcers.values())[:cmd.get("count", len(announcers))]
                for a in chosen:
                    await a.publish()
                    await asyncio.sleep(cmd["seconds"] / max(len(chosen), 1))
                reply = {"ok": True, "published": len(chosen)}
            elif cmd["op"] == "peers":  # one holder's connections and its mesh on the topic (diagnostics)
                a = announcers.get(cmd["holder"])
                node = a.dht if a is not None else None
                reply = {"connected": len(await node.connected_peers()) if node else None,
                         "topic": len(await node.topic_peers(a.gossip.topic)) if node and a.gossip else None}
            elif cmd["op"] == "profile":
                reply = await asyncio.to_thread(_profile, cmd["seconds"])
            else:
                break
            print(json.dumps(reply), flush=True)
    finally:
        async def stop(node: P2PNode) -> None:
            with contextlib.suppress(Exception):
                await node.stop()
        await asyncio.gather(*(stop(n) for n in nodes))


def _refused(announcers: dict[int, Any]) -> dict[str, int]:
    """Announcement messages the holders' gates refused, by reason."""
    out: dict[str, int] = {}
    for a in announcers.values():
        if a.gossip is not None:
            for k, v in a.gossip.gate.refused.items():
                out[k] = out.get(k, 0) + v
    return out


def _messages(announcers: dict[int, Any]) -> int:
    """Announcement messages the holders' gates have checked (each first copy a holder received)."""
    return sum(a.gossip.gate.accepted + sum(a.gossip.gate.refused.values())
               for a in announcers.values() if a.gossip is not None)


# ---------------------------------------------------------------- the coordinator


class PeerSwarm:
    """``holders`` holder peers in worker processes of ``per_process`` each, plus a seed node
    here; ``backbone()`` adds a backbone (P2PNode + Discovery) in this process."""

    def __init__(self, holders: int, per_process: int = 50, *, layers: int = 1, ttl_s: float = 600.0,
                 concurrency: int = 4, max_connections: int = 64, dht: bool = False,
                 start_timeout_s: float = 600.0) -> None:
        self.holders, self.per_process, self.layers, self.ttl_s = holders, per_process, layers, ttl_s
        self.start_timeout_s = start_timeout_s  # bound on each worker's seeds and ready lines
        self.dht = dht
        self.concurrency, self.max_connections = concurrency, max_connections
        self.workers: list[subprocess.Popen[str]] = []
        self.owner: dict[int, subprocess.Popen[str]] = {}
        self.seed: Any = None
        self.bootstrap: tuple[str, ...] = ()
        self._stack = contextlib.AsyncExitStack()
        self.startup_s = 0.0
        self.started: list[dict[str, Any]] = []

    async def __aenter__(self) -> PeerSwarm:
        from moeswarm.net.p2p import P2PConfig, P2PNode
        from moeswarm.protocol import Identity

        t0 = time.monotonic()
        self.seed = await self._stack.enter_async_context(P2PNode(Identity.generate(), P2PConfig(max_connections=1024)))  # every holder dials it
        self.bootstrap = (self.seed.multiaddrs[0],)
        try:
            # each worker's first holders dial the seed node and the first three holders of one
            # earlier worker, chosen at random (a tree of workers, one connected topic); the first
            # worker's are also the backbones' bootstrap. Not the first worker's for every worker:
            # a holder keeps at most max_connections (pruned above 3/4 of it), and with 20 workers
            # on its three holders the cross-process links, hence the topic, were thinned there
            # workers start in waves (1, 1, 2, 4, ...: as many as have printed their seeds), so
            # that no worker waits for every one before it
            rng = random.Random(self.holders)
            seeds: list[tuple[str, ...]] = []
            firsts = list(range(0, self.holders, self.per_process))
            while len(self.workers) < len(firsts):
                wave = firsts[len(self.workers):len(self.workers) + max(1, len(seeds))]
                for first in wave:
                    self._spawn(first, self.bootstrap[:1] + (rng.choice(seeds) if seeds else ()))
                for worker in self.workers[-len(wave):]:
                    seeds.append(tuple((await self._read(worker, timeout_s=self.start_timeout_s))["seeds"]))
                if len(self.bootstrap) == 1:  # the first worker's: the backbones' bootstrap too
                    self.bootstrap += seeds[0]
            for worker in self.workers:
                await self._ready(worker)
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def _spawn(self, first: int, bootstrap: tuple[str, ...]) -> None:
        count = min(self.per_process, self.holders - first)
        self.workers.append(subprocess.Popen(
            [sys.executable, __file__, "--first", str(first), "--count", str(count), "--layers",
             str(self.layers), "--ttl", str(self.ttl_s), "--concurrency", str(self.concurrency),
             "--max-connections", str(self.max_connections), *(["--dht"] if self.dht else []),
             "--new-keys-burst", str(max(self.holders, 200)), *bootstrap],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"}))

    async def _ready(self, worker: subprocess.Popen[str]) -> None:
        ready = await self._read(worker, timeout_s=self.start_timeout_s)
        self.started.append(ready)
        for i in ready["ready"]:
            self.owner[i] = worker

    async def __aexit__(self, *exc: object) -> None:
        for worker in self.workers:
            with contextlib.suppress(Exception):
                assert worker.stdin is not None
                worker.stdin.write("\n")
                worker.stdin.flush()
        for worker in self.workers:
            try:
                await asyncio.to_thread(worker.wait, 60)
            except subprocess.TimeoutExpired:
                worker.kill()
                await asyncio.to_thread(worker.wait)
            for pipe in (worker.stdin, worker.stdout):
                if pipe is not None:
                    with contextlib.suppress(OSError):  # a worker that died: its stdin is a broken pipe
                        pipe.close()
        await self._stack.aclose()

    async def _read(self, worker: subprocess.Popen[str], timeout_s: float = 120) -> dict[str, Any]:
        assert worker.stdout is not None
        async with asyncio.timeout(timeout_s):
            line = await asyncio.to_thread(worker.stdout.readline)
        if not line.startswith("{"):
            raise RuntimeError(f"a peer_swarm worker said {line!r} (exit {worker.poll()})")
        return json.loads(line)

    async def command(self, worker: subprocess.Popen[str], **cmd: Any) -> dict[str, Any]:
        assert worker.stdin is not None
        worker.stdin.write(json.dumps(cmd) + "\n")
        worker.stdin.flush()
        return await self._read(worker)

    async def withdraw(self, holder: int) -> None:
        await self.command(self.owner[holder], op="withdraw", holder=holder)

    async def move(self, holder: int, experts: tuple[int, int]) -> None:
        await self.command(self.owner[holder], op="move", holder=holder, experts=list(experts))

    async def refresh(self, seconds: float, count: int | None = None) -> int:
        """Every holder (``count``: about that many in all) publishes its record once more, spread
        over ``seconds`` (all workers at once); returns how many did."""
        each = None if count is None else -(-count // len(self.workers))
        for worker in self.workers:
            assert worker.stdin is not None
            worker.stdin.write(json.dumps({"op": "refresh", "seconds": seconds,
                                           **({} if each is None else {"count": each})}) + "\n")
            worker.stdin.flush()
        return sum([(await self._read(w, timeout_s=seconds + 300))["published"] for w in self.workers])

    async def profile(self, seconds: float) -> list[dict[str, Any]]:
        """Every worker's sampled profile over the same ``seconds`` (``_profile``)."""
        for worker in self.workers:
            assert worker.stdin is not None
            worker.stdin.write(json.dumps({"op": "profile", "seconds": seconds}) + "\n")
            worker.stdin.flush()
        return [await self._read(w, timeout_s=seconds + 120) for w in self.workers]

    async def stats(self) -> list[dict[str, Any]]:
        return [await self.command(w, op="stats") for w in self.workers]

    async def backbone(self, **discovery: Any) -> Any:
        """A backbone's discovery in this process, closed with the swarm; its table is ``.table``."""
        from moeswarm.net.discovery import Discovery
        from moeswarm.net.p2p import P2PConfig, P2PNode
        from moeswarm.net.routing_table import SwarmTable
        from moeswarm.protocol import Identity

        node = await self._stack.enter_async_context(P2PNode(Identity.generate(), P2PConfig(bootstrap=self.bootstrap)))
        found = Discovery(node, SwarmTable(MODEL), range(self.layers), num_layers=self.layers,
                          num_experts=self.holders, **discovery)
        self._stack.push_async_callback(found.aclose)
        return found


def main() -> None:
    parser = argparse.ArgumentParser(description="a worker of tests/peer_swarm.py")
    parser.add_argument("bootstrap", nargs="+")
    parser.add_argument("--first", type=int, required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--ttl", type=float, default=600.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-connections", type=int, default=64)
    parser.add_argument("--dht", action="store_true", help="also store each record in the DHT")
    parser.add_argument("--new-keys-burst", type=float, default=0.0,
                        help="holders' budget of new keys per forwarding address (0: the default)")
    asyncio.run(_worker(parser.parse_args()))


if __name__ == "__main__":
    main()
