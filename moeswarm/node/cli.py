"""``moeswarm node`` and ``moeswarm backbone``: the swarm daemons' command lines."""

from __future__ import annotations

import logging

import click

from .._cli_util import DEFAULT_MTP_DRAFT, friendly_errors, host_port, http_limit_options, http_limits
from ..daemon import check_listen, run_daemon


def swarm_options(fn):  # type: ignore[no-untyped-def]
    """Options shared by every process that joins a swarm."""
    options = [
        click.option("--model", "model_dir", required=True, type=click.Path(),
                     help="Hugging Face model folder, or a GGUF file (the same checkpoint every peer of this model uses). "
                          "Vision-language checkpoints (MiniMax M3, Kimi K2.5, Mistral Large 4) serve text: images are not "
                          "supported yet."),
        click.option("--bootstrap", multiple=True, metavar="MULTIADDR",
                     help="A peer to join through, e.g. /ip4/1.2.3.4/tcp/4001/p2p/12D3Koo... (repeatable). "
                          "Without it this process is a bootstrap peer."),
        click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on."),
        click.option("--announce-host", default=None, help="Address others dial, if not --host (e.g. your public IP)."),
        click.option("--p2p-port", default=0, type=int, show_default=True, help="libp2p TCP port (0 = any free)."),
        click.option("--client-mode", is_flag=True, help="Behind NAT: use the DHT without serving it."),
        click.option("--model-id", default=None, help="Name of the model in the swarm (default: derived from the checkpoint's config and, for GGUF, how its experts are encoded)."),
        click.option("--identity", "identity_file", default=None, type=click.Path(),
                     help="File holding this peer's Ed25519 key (created if missing). Default: a new key each run."),
        click.option("--relay-ca", default=None, type=click.Path(exists=True, dir_okay=False),
                     help="Trust this CA for relays of NAT'd devices (default: the system trust store)."),
        click.option("-v", "--verbose", count=True, help="More logging on stderr."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def swarm_config(model_dir: str, bootstrap: tuple[str, ...], host: str, announce_host: str | None, p2p_port: int,
                 client_mode: bool, model_id: str | None, identity_file: str | None, relay_ca: str | None,
                 verbose: int):  # type: ignore[no-untyped-def]
    from ..daemon import SwarmConfig

    if relay_ca is not None:
        from ..relay import set_relay_ca

        set_relay_ca(relay_ca)

    logging.basicConfig(level=logging.WARNING - 10 * min(verbose, 2), format="%(asctime)s %(name)s %(message)s")
    return SwarmConfig(model_dir, tuple(bootstrap), host, announce_host, p2p_port, client_mode, model_id,
                       identity_file)


@click.command()
@swarm_options
@click.option("--layers", default=None, metavar="A-B",
              help="Layers to hold, inclusive (default: all the decoder's). A range may reach past them into "
                   "the checkpoint's multi-token-prediction layers (DeepSeek-V3: 61), whose experts a "
                   "`backbone --draft mtp` calls.")
@click.option("--experts", default=None, metavar="X-Y|auto",
              help="Experts to hold in each of those layers, inclusive: 0-31 is 32 experts (default: all). "
                   "'auto' asks the swarm's market what it lacks (then --layers is chosen too).")
@click.option("--capacity", default=None, metavar="SIZE",
              help="With --experts auto: memory to give to expert weights (default: --memory-budget, "
                   "else half the free RAM).")
@click.option("--device-class", default="hub", show_default=True, type=click.Choice(["hub", "edge"]),
              help="With --experts auto: hub machines take hot experts, edge devices the long tail.")
@click.option("--max-blocks", default=64, show_default=True, type=click.IntRange(1, 64),
              help="With --experts auto: blocks (a layer range x an expert range each) this node may hold and "
                   "announce in its one record; the market uses as many as gather the experts worth most.")
@click.option("--rebalance-interval", default=600.0, show_default=True, type=click.FloatRange(min=0),
              metavar="SECONDS",
              help="With --experts auto: ask the market about this often whether another block is clearly worth "
                   "more, and move there, never dropping experts that no other node holds; 0 = never.")
@click.option("--port", "data_port", default=0, type=int, show_default=True,
              help="Data-plane (expert calls, TLS) port; 0 = any free.")
@click.option("--announce-port", default=None, type=int,
              help="Data-plane port others dial, if a NAT or proxy forwards a different one to --port.")
@click.option("--memory-budget", default=None, metavar="SIZE",
              help="Keep resident memory under SIZE (e.g. 8GB): experts are paged in from the memory-mapped "
                   "checkpoint when called and dropped when least recently used.")
@click.option("--status", "status", default="127.0.0.1:0", show_default=True, metavar="HOST:PORT|off",
              help="Serve /status (JSON) and /metrics (Prometheus) here, for `moeswarm node status`.")
@click.option("--probe-interval", default=30.0, show_default=True, type=click.FloatRange(min=0), metavar="SECONDS",
              help="Re-measure round trip and bandwidth (each direction) to the other holders this often; 0 = never.")
@click.option("--no-weight-fetches", is_flag=True,
              help="Refuse to send expert weights to fetching backbones (a metered uplink); calls are still served.")
@click.option("--require-funded", default=None, metavar="LEDGER_URL",
              help="Serve only clients this ledger says hold credit (their receipts would be refused otherwise). "
                   "Off by default.")
@click.option("--market-ledger", default=None, metavar="LEDGER_URL",
              help="With --experts auto: weigh backbones' demand reports by what each paid this ledger, so keys "
                   "without standing cannot steer the market (default: every signed report counts).")
@click.option("--max-connections", default=1024, show_default=True, type=click.IntRange(min=1),
              help="Data plane: connections held at once, all peers together.")
@click.option("--max-conns-per-ip", default=32, show_default=True, type=click.IntRange(min=1),
              help="Data plane: connections held at once from one IPv4 address or one IPv6 /64.")
@click.option("--max-conns-per-peer", default=4, show_default=True, type=click.IntRange(min=1),
              help="Data plane: authenticated connections held at once by one peer key.")
@click.option("--frame-timeout", default=10.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              metavar="SECONDS", help="Data plane: once a frame's header arrived, its body must follow within "
                                      "this plus one second per MB.")
@click.option("--idle-timeout", default=300.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              metavar="SECONDS", help="Data plane: close a connection that sent nothing this long with no "
                                      "request in flight.")
@click.option("--protocol-versions", default="1,2", show_default=True, metavar="N[,N]",
              help="Data plane: the protocol versions offered, ascending. 2 (spec v1.3) signs receipts in batches, "
                   "off the answer's path; '1' answers every call with its own signed receipt, as v1.2 nodes do.")
@friendly_errors
def node(layers: str | None, experts: str | None, capacity: str | None, device_class: str, max_blocks: int,
         rebalance_interval: float, data_port: int, announce_port: int | None, memory_budget: str | None,
         status: str, probe_interval: float, no_weight_fetches: bool, require_funded: str | None,
         market_ledger: str | None, max_connections: int, max_conns_per_ip: int, max_conns_per_peer: int,
         frame_timeout: float, idle_timeout: float, protocol_versions: str, **swarm: object) -> None:
    """Volunteer a share of a model's experts to the swarm.

    Loads only the chosen experts (memory-mapped), serves them over TLS, and announces them in
    the swarm's DHT until stopped (Ctrl-C withdraws the announcement). Examples:

    \b
      # the first node of a new swarm (no --bootstrap): others join through it
      moeswarm node --model ./mixtral --experts 0-3
      # join an existing swarm through any peer's multiaddr (printed in its READY line)
      moeswarm node --model ./mixtral --layers 0-31 --experts 4-7 \\
          --bootstrap /ip4/203.0.113.5/tcp/4001/p2p/12D3KooW...
      # behind a NAT with a forwarded port: listen on all interfaces, announce the public address
      moeswarm node --model ./mixtral --experts 0-7 --host 0.0.0.0 --announce-host 203.0.113.9 \\
          --p2p-port 4001 --port 4002 --identity ~/.moeswarm/node.key --bootstrap ...

    Every peer must use the same checkpoint (the model id is derived from its config.json).

    Prints `READY {json}` (peer_id, multiaddrs, endpoint, status URL) on stdout once serving, and
    with --experts auto a `REBALANCE {json}` line (action, reason, layers, experts, more_blocks) per
    re-evaluation; what it is doing, in words, on stderr. Ctrl-C or SIGTERM withdraws and stops
    within seconds (a second one stops at once). `moeswarm node status` shows what a running node
    measures and plans.
    """
    from ..model.memory import parse_size
    from .config import NodeConfig
    from .volunteer import run_node

    budget = parse_size(memory_budget) if memory_budget is not None else None
    config = NodeConfig(swarm_config(**swarm), layers, experts, data_port, announce_port,  # type: ignore[arg-type]
                        memory_budget=budget, capacity_bytes=parse_size(capacity) if capacity else None,
                        device_class=device_class, max_blocks=max_blocks, rebalance_interval_s=rebalance_interval,
                        status=None if status == "off" else host_port(status, "--status"), probe_interval_s=probe_interval,
                        serve_weights=not no_weight_fetches, require_funded=require_funded,
                        market_ledger=market_ledger, max_connections=max_connections,
                        max_conns_per_ip=max_conns_per_ip, max_conns_per_peer=max_conns_per_peer,
                        frame_timeout_s=frame_timeout, idle_timeout_s=idle_timeout,
                        protocol_versions=parse_versions(protocol_versions))
    check_listen(config.swarm.host, data_port, "--port")
    if config.status is not None:
        check_listen(*config.status, "--status")
    check_listen(config.swarm.host, config.swarm.p2p_port, "--p2p-port")
    run_daemon(run_node(config))


@click.command()
@swarm_options
@click.option("--http", "http", default="127.0.0.1:8000", show_default=True, metavar="HOST:PORT",
              help="Serve the OpenAI-compatible API here (port 0 = any free).")
@click.option("--local-fallback", is_flag=True, help="Compute experts nobody serves from the local checkpoint.")
@click.option("--coverage-timeout", default=60.0, show_default=True, help="Seconds to wait for every expert to be announced.")
@click.option("--ledger", "ledger_url", default=None, metavar="URL",
              help="Submit countersigned receipts to this ledger service (moeswarm-ledger serve).")
@click.option("--ledger-queue", default=None, type=click.Path(),
              help="Spool folder for receipts not yet acknowledged (default: ~/.moeswarm/receipts/PEER).")
@click.option("--audit-fraction", default=0.0, show_default=True, type=click.FloatRange(0, 1), metavar="F",
              help="With --ledger: have the ledger re-execute this share of expert calls (e.g. 0.01); a server "
                   "caught lying gets signed evidence and its receipts of the epoch are withheld.")
@click.option("--tiers", default="remote", show_default=True, type=click.Choice(["remote", "auto", "fetch"]),
              help="remote: call every routed expert in the swarm. auto: the tier planner decides per expert, "
                   "from measured links and disk, whether to compute it here from the checkpoint, call a "
                   "holder, or fetch its weights into a local cache. fetch: fetch every expert's weights "
                   "from a holder on a cache miss and compute it here (remote RAM as the cold tier). "
                   "Fetched weights are checked against expert_digests.json in the model folder, if there "
                   "(see `moeswarm expert-digests`).")
@click.option("--fetch-cache", default="1GB", show_default=True, metavar="SIZE",
              help="With --tiers auto or fetch: memory for expert weights fetched from holders.")
@click.option("--probe-interval", default=30.0, show_default=True, type=click.FloatRange(min=0), metavar="SECONDS",
              help="Re-measure round trip and bandwidth (each direction) to the holders this often; 0 = never.")
@click.option("--verify-fraction", default=0.05, show_default=True, type=click.FloatRange(0, 1), metavar="F",
              help="Check this share of a trusted holder's expert calls before using their outputs (by recomputing "
                   "from this checkpoint, else by asking a second and third holder); a holder caught returning "
                   "wrong numbers is excluded at once and signed evidence goes into the DHT. 0 turns checks off.")
@click.option("--probation-calls", default=8, show_default=True, type=click.IntRange(min=0), metavar="N",
              help="Check every one of a new holder's first N calls; holders that passed are preferred.")
@click.option("--verify-by", default="auto", show_default=True, type=click.Choice(["auto", "local", "holders"]),
              help="auto: recompute where the checkpoint holds the experts, else ask other holders; "
                   "local: recompute only; holders: ask other holders only.")
@click.option("--spot-check-fraction", default=1.0, show_default=True, type=click.FloatRange(0, 1), metavar="F",
              help="After probation, of the calls not checked in full, recompute one random row per expert of this "
                   "share (where this checkpoint holds the experts; chosen after the answer, unseen by the holder). "
                   "1 catches a liar at its first lie; for one-token decode it costs the call's compute here.")
@click.option("--max-batch", default=16, show_default=True, type=click.IntRange(min=1), metavar="N",
              help="Sequences advanced together in one forward pass (continuous batching): one request per "
                   "expert holder per MoE layer carries all of them. 1 serves one user at a time.")
@click.option("--prefill-chunk", default=256, show_default=True, type=click.IntRange(min=1), metavar="TOKENS",
              help="Prompt tokens fed per step, shared by the requests joining, so a long prompt does not "
                   "stall the streams already decoding.")
@click.option("--kv-cache", default="256MB", show_default=True, metavar="SIZE",
              help="Memory for every sequence's attention cache, in fixed-size blocks; a request that cannot "
                   "get its worst case (prompt + max_tokens) waits.")
@click.option("--max-waiting", default=64, show_default=True, type=click.IntRange(min=1), metavar="N",
              help="Requests waiting for a place in the batch beyond which new ones get 503 with Retry-After.")
@click.option("--speculative", default=0, show_default=True, type=click.IntRange(min=0), metavar="K",
              help="Speculative decoding: verify up to K draft tokens per step and sequence (prompt lookup, "
                   "or --draft-model); the output keeps the model's distribution exactly (greedy: the "
                   "greedy tokens). 0 = off.")
@click.option("--draft-model", default=None, type=click.Path(exists=True),
              help="With --speculative: a small checkpoint with the same tokenizer, computed here, that "
                   "proposes the drafts.")
@click.option("--draft", default="lookup", show_default=True, type=click.Choice(["lookup", "mtp"]),
              help="What proposes the drafts: prompt lookup (or --draft-model), or mtp: the checkpoint's own "
                   "multi-token-prediction layer (its experts called in the swarm like any layer's); "
                   f"--draft mtp without --speculative drafts {DEFAULT_MTP_DRAFT} tokens per step.")
@click.option("--api-key", default=None, envvar="MOESWARM_API_KEY", metavar="KEY",
              help="Require 'Authorization: Bearer KEY' on the HTTP API (required when --http is not loopback; "
                   "also read from MOESWARM_API_KEY).")
@click.option("--max-tokens-cap", default=4096, show_default=True, type=click.IntRange(min=1),
              help="The HTTP API refuses requests for more new tokens than this.")
@click.option("--gateway", is_flag=True,
              help="Serve other people's requests: announce this API in the swarm (URL, model, free batch places, "
                   "price, measured round trip to the holders), for `moeswarm complete`/`chat` and the SDK to find. "
                   "A gateway serves anyone without --api-key, also off loopback (with --gateway-price, only "
                   "people whose spending authorization pays).")
@click.option("--gateway-price", default=0, show_default=True, type=click.IntRange(min=0), metavar="CREDITS",
              help="With --gateway: credits per generated token a person pays (their spending authorization "
                   "signs this figure).")
@click.option("--gateway-url", default=None, metavar="URL",
              help="With --gateway: the API URL to announce (default: http://ANNOUNCE-HOST-or-HOST:PORT of --http).")
@http_limit_options
@friendly_errors
def backbone(http: str, local_fallback: bool, coverage_timeout: float, ledger_url: str | None,
             ledger_queue: str | None, audit_fraction: float, tiers: str, fetch_cache: str, probe_interval: float,
             verify_fraction: float, probation_calls: int, verify_by: str, spot_check_fraction: float, max_batch: int, prefill_chunk: int,
             kv_cache: str, max_waiting: int, speculative: int, draft_model: str | None, draft: str,
             api_key: str | None, max_tokens_cap: int, gateway: bool, gateway_price: int, gateway_url: str | None,
             **swarm: object) -> None:
    """Run a backbone: attention, routers and the LM head here; routed experts from the swarm.

    Serves /v1/models, /v1/completions and /v1/chat/completions, and /status and /metrics.
    Prints `READY {json}` (peer_id, multiaddrs, http) on stdout once serving, and what it is doing,
    in words, on stderr. Ctrl-C or SIGTERM drains and stops within seconds.
    """
    from ..model.memory import parse_size
    from .backbone import run_backbone
    from .config import BackboneConfig
    from .scheduler import EngineConfig
    from .verify import VerifyConfig

    if draft == "mtp" and not speculative:
        speculative = DEFAULT_MTP_DRAFT
    engine = EngineConfig(max_batch=max_batch, prefill_chunk=prefill_chunk, kv_cache_bytes=parse_size(kv_cache),
                          max_waiting=max_waiting, speculative=speculative)
    limits = http_limits(swarm)  # popped: the rest are the swarm's options
    config = BackboneConfig(swarm_config(**swarm), host_port(http, "--http"), local_fallback, coverage_timeout,  # type: ignore[arg-type]
                            ledger_url=ledger_url, ledger_queue_dir=ledger_queue, audit_fraction=audit_fraction,
                            tiers=tiers, fetch_cache_bytes=parse_size(fetch_cache), probe_interval_s=probe_interval,
                            verify=VerifyConfig(verify_fraction, probation_calls, verify_by, spot_fraction=spot_check_fraction),
                            engine=engine, draft_model=draft_model, draft=draft, api_key=api_key,
                            max_tokens_cap=max_tokens_cap, http_limits=limits, gateway=gateway,
                            gateway_price=gateway_price, gateway_url=gateway_url)
    assert config.http is not None
    check_listen(*config.http, "--http")
    check_listen(config.swarm.host, config.swarm.p2p_port, "--p2p-port")
    run_daemon(run_backbone(config))


def parse_versions(text: str) -> tuple[int, ...]:
    """``--protocol-versions``: "1,2" -> (1, 2), each one this build speaks, ascending."""
    from ..protocol import SUPPORTED_VERSIONS

    try:
        versions = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of versions", param_hint="--protocol-versions")
    if not versions or list(versions) != sorted(set(versions)) or not set(versions) <= set(SUPPORTED_VERSIONS):
        raise click.BadParameter(f"give versions from {list(SUPPORTED_VERSIONS)}, ascending, not {text!r}",
                                 param_hint="--protocol-versions")
    return versions


@click.command("status")
@click.option("--url", "urls", multiple=True, metavar="URL",
              help="A daemon's status URL (from its READY line); default: every node and backbone running here.")
@click.option("--json", "as_json", is_flag=True, help="Print the raw reports as JSON.")
@click.option("--experts", "show_experts", is_flag=True, help="List the planned tier of every expert, layer by layer.")
@friendly_errors
def node_status(urls: tuple[str, ...], as_json: bool, show_experts: bool) -> None:
    """Show what running nodes and backbones measure and decide.

    For each: what it holds and served, memory (VmSize/VmRSS/VmSwap, faults, disk reads), the
    expert cache, round trip and bandwidth to each peer in each direction, and the tier plan
    (how many experts it would compute from its own checkpoint, call on a holder, or fetch),
    with the tokens/s the plan predicts.
    """
    import json

    from .status import fetch_reports, render_report

    reports = fetch_reports(list(urls))
    if as_json:
        click.echo(json.dumps(reports, indent=2, sort_keys=True))
        return
    if not reports:
        click.echo("no moeswarm node or backbone is running here (give --url to ask another)")
        return
    for report in reports:
        render_report(report, show_experts)


@click.command("expert-digests")
@click.option("--model", "model_dir", required=True, type=click.Path(exists=True),
              help="The full checkpoint: a Hugging Face model folder, or a GGUF file.")
@click.option("--out", default=None, type=click.Path(dir_okay=False),
              help="File to write (default: expert_digests.json in the checkpoint's folder).")
@click.option("--model-id", default=None, help="Model id to record (default: derived from the checkpoint).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@friendly_errors
def expert_digests(model_dir: str, out: str | None, model_id: str | None, quiet: bool) -> None:
    """Write a SHA-256 of every routed expert, for backbones that fetch weights to check them.

    Run it once on the published checkpoint and ship the file with it (a backbone-only copy of
    the model keeps it).  A backbone with --tiers auto or fetch whose model folder holds the file
    refuses fetched experts that differ from it, and calls their holders instead.  Digests cover
    the bytes a holder sends: a GGUF's quantised experts get their own file.

    \b
    Example:
      moeswarm expert-digests --model models/mixtral
    """
    from pathlib import Path

    from ..model import load_weights
    from ..model.model_id import model_id_for
    from .fetch import DIGESTS_FILE, write_expert_digests

    weights = load_weights(model_dir)
    path = Path(out) if out else Path(weights.folder) / DIGESTS_FILE
    n = write_expert_digests(weights, path, model_id=model_id or model_id_for(model_dir, weights.config),
                             progress=not quiet)
    click.echo(f"wrote {path}: {n} experts")
