"""One person's tokens per second at internet distance: a home backbone, a gateway near the experts,
a gateway with the model's own multi-token prediction (issue 30).

The testbed, on this machine (loopback, delay proxies: benchmarks/_delay.py via _links.py):

- the hub region: expert nodes whose data plane is ``--hub-rtt-ms`` (1 ms) away from the gateways
  that call them;
- the person: ``--person-rtt-ms`` (30 ms) from the hub. A home backbone runs on the person's
  machine, so its every expert call crosses those 30 ms (a second swarm of the same nodes, whose
  data plane is 30 ms away); a gateway runs in the hub, so only the person's HTTP stream crosses
  them (a delay proxy in front of the gateway's API, which the gateway announces as its URL).

Cases, alternated ``--rounds`` times, one greedy stream of ``--tokens`` tokens each (``ignore_eos``):
home backbone; gateway in the hub (found in the DHT, chosen by ``moeswarm.sdk.gateway``); gateway +
MTP (``backbone --draft mtp``, the backbone's default draft length unless ``--speculative K``). Printed per case: median decode tok/s (tokens after the first /
time from the first to the last), median time to the first token, and whether the greedy tokens
equal the home backbone's. Then the simulation's figures for M3 (``benchmarks/swarm_sim.py``'s
``gateway_rows``: three regions, a person in each; ``--sim full`` as ``swarm_sim.py --regions``,
``--sim quick`` a third of the volunteers, ``--sim off`` None). The last line is one JSON object::

    {"home_tok_s": ..., "gateway_tok_s": ..., "gateway_mtp_tok_s": ..., "sim_m3_gateway_tok_s": ...,
     "sim_m3_home_tok_s": ..., "mtp_acceptance": ...}

    python benchmarks/gateway.py [--tokens 32] [--rounds 3] [--hub-rtt-ms 1] [--person-rtt-ms 30] [--speculative K]

Every process runs with OPENBLAS_NUM_THREADS=1. Figures measured while other work shares the machine are noisy.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import contextlib
import http.client
import json
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from _delay import spawn_delay_proxy  # benchmarks/_delay.py
from _links import _free_port, delayed_swarm, mtp_layers  # benchmarks/_links.py

from moeswarm.demo import CHECKPOINT
from moeswarm.demo.swarm import Daemon, start_daemon, stop_daemon

RANGES = ["0-3", "4-7"]
PROMPT = "And it came to pass"


@dataclass
class Stream:
    ids: list[int]
    first_s: float  # request sent -> first token
    decode_tok_s: float  # tokens after the first / (last token - first token)


def stream(url: str, tokens: int, timeout: float = 300.0) -> Stream:
    """One greedy streamed completion of ``tokens`` tokens from an OpenAI API at ``url``."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout)
    body = {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "return_token_ids": True}
    ids: list[int] = []
    times: list[float] = []
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}: {response.read()[:300]!r}")
        for line in response:
            text = line.decode().strip()
            if text == "data: [DONE]":
                break
            if text.startswith("data: {"):
                for choice in json.loads(text[6:]).get("choices", []):
                    new = choice.get("token_ids") or []
                    ids += new
                    times += [time.perf_counter()] * len(new)
    finally:
        conn.close()
    decode = (len(ids) - 1) / (times[-1] - times[0]) if len(ids) > 1 and times[-1] > times[0] else float("nan")
    return Stream(ids, times[0] - t0 if times else float("nan"), decode)


@contextlib.contextmanager
def gateway(boot: str, person_delay_s: float, extra: list[str], name: str) -> Iterator[tuple[Daemon, str]]:
    """A gateway in the hub whose API the person reaches through a delay proxy (announced as its URL)."""
    port = _free_port()
    proxy = spawn_delay_proxy("127.0.0.1:0", f"127.0.0.1:{port}", person_delay_s)
    url = f"http://127.0.0.1:{proxy.port}"
    daemon = None
    try:
        daemon = start_daemon(name, ["backbone", "--model", str(CHECKPOINT), "--bootstrap", boot, "--http",
                                     f"127.0.0.1:{port}", "--gateway", "--gateway-url", url, "--probe-interval", "5",
                                     *extra])
        yield daemon, url
    finally:
        if daemon is not None:
            stop_daemon(daemon)
        proxy.close()


def chosen_gateway(boot: str) -> str:
    """The URL ``moeswarm.sdk.gateway`` picks among the gateways the hub's DHT lists."""
    from moeswarm.sdk.gateway import GatewayClient, find_gateways

    client = GatewayClient(find_gateways([boot], None, wait_s=30))
    return client.candidates[0].record.url


def sim_figures(quick: bool) -> dict[str, Any]:
    """One person's decode on M3 through a gateway in their region and from a home backbone:
    ``benchmarks/swarm_sim.py``'s regions simulation (``gateway_rows``), printed as its table."""
    import swarm_sim  # benchmarks/swarm_sim.py

    figures = swarm_sim.gateway_rows(quick=quick, shapes=("m3",))
    print(swarm_sim.gateway_table(figures))
    return figures


def status_of(url: str) -> dict[str, Any]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=30)
    try:
        conn.request("GET", "/status")
        return dict(json.loads(conn.getresponse().read()))
    finally:
        conn.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--hub-rtt-ms", type=float, default=1.0)
    p.add_argument("--person-rtt-ms", type=float, default=30.0)
    p.add_argument("--speculative", type=int, default=None,
                   help="MTP draft tokens per step (default: the backbone's own default for --draft mtp)")
    p.add_argument("--sim", choices=("full", "quick", "off"), default="quick",
                   help="the regions simulation of swarm_sim.py for the sim_* figures")
    a = p.parse_args()
    person_delay = a.person_rtt_ms / 2e3
    results: dict[str, list[Stream]] = {"home backbone": [], "gateway in the hub": [], "gateway + MTP": []}
    acceptance = None
    with contextlib.ExitStack() as stack:
        layers = mtp_layers(str(CHECKPOINT))  # the decoder's layers and its MTP layer, for --draft mtp
        hub = stack.enter_context(delayed_swarm(str(CHECKPOINT), RANGES, a.hub_rtt_ms, layers=layers))
        far = stack.enter_context(delayed_swarm(str(CHECKPOINT), RANGES, a.person_rtt_ms, layers=layers))
        hub_boot, far_boot = hub[0].info["multiaddrs"][0], far[0].info["multiaddrs"][0]
        home = start_daemon("home", ["backbone", "--model", str(CHECKPOINT), "--bootstrap", far_boot, "--http",
                                     "127.0.0.1:0", "--probe-interval", "5"])
        stack.callback(stop_daemon, home)
        _, gw_url = stack.enter_context(gateway(hub_boot, person_delay, [], "gateway"))
        urls = {"home backbone": home.info["http"], "gateway in the hub": chosen_gateway(hub_boot)}
        assert urls["gateway in the hub"] == gw_url, (urls, gw_url)
        spec_args = ["--draft", "mtp"] + (["--speculative", str(a.speculative)] if a.speculative else [])
        mtp_daemon, mtp_url = stack.enter_context(gateway(hub_boot, person_delay, spec_args, "gw-mtp"))
        urls["gateway + MTP"] = mtp_url
        for url in urls.values():
            stream(url, 4)  # warm up: connections, link probes, first pages
        for _ in range(a.rounds):
            for case, url in urls.items():
                results[case].append(stream(url, a.tokens))
        if mtp_url:
            spec = status_of(mtp_daemon.info["status"]).get("speculative", {})
            acceptance = spec["accepted"] / spec["drafted"] if spec.get("drafted") else None
    ref = results["home backbone"][0].ids if results["home backbone"] else []
    print(f"\none stream, {a.tokens} greedy tokens, holders {a.hub_rtt_ms:g} ms apart in the hub, the person "
          f"{a.person_rtt_ms:g} ms away; median of {a.rounds} alternated rounds; load average at the end "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\n")
    print(f"{'case':<22} {'decode tok/s':>13} {'first token s':>14}  same tokens as home")
    med: dict[str, float | None] = {}
    for case, runs in results.items():
        if not runs:
            med[case] = None
            print(f"{case:<22} no runs")
            continue
        med[case] = statistics.median(r.decode_tok_s for r in runs)
        same = all(r.ids == ref for r in runs)
        print(f"{case:<22} {med[case]:>13.2f} {statistics.median(r.first_s for r in runs):>14.3f}  {same}")
    if acceptance is not None:
        print(f"MTP draft acceptance: {acceptance:.1%}")
    sim = sim_figures(a.sim == "quick") if a.sim != "off" else {}
    print(json.dumps({"home_tok_s": med["home backbone"], "gateway_tok_s": med["gateway in the hub"],
                      "gateway_mtp_tok_s": med["gateway + MTP"], "sim_m3_gateway_tok_s": sim.get("sim_m3_gateway_tok_s"),
                      "sim_m3_home_tok_s": sim.get("sim_m3_home_tok_s"), "mtp_acceptance": acceptance}))


if __name__ == "__main__":
    main()
