"""``moeswarm bridge`` and ``moeswarm export-onnx``: the edge device's command lines."""

from __future__ import annotations

import json
import logging

import click

from .._cli_util import friendly_errors


@click.command("export-onnx")
@click.option("--model", "model_dir", required=True, type=click.Path(file_okay=False),
              help="Hugging Face model folder (config.json + *.safetensors).")
@click.option("--layers", default=None, metavar="A-B", help="Layers to export, inclusive (default: all).")
@click.option("--experts", default=None, metavar="X-Y", help="Experts to export in each MoE layer, inclusive (default: all).")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Folder to write the shards to.")
@click.option("--dtype", default="fp32", show_default=True, type=click.Choice(["fp32", "fp16"]),
              help="Weights and arithmetic: fp32 matches the engine to 1e-5, fp16 halves the bytes.")
@click.option("--model-id", default=None, help="Name of the model in the swarm (default: from config.json, as nodes).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@friendly_errors
def export_onnx(model_dir: str, layers: str | None, experts: str | None, out_dir: str, dtype: str,
                model_id: str | None, quiet: bool) -> None:
    """Export a checkpoint's experts as ONNX layer shards for `moeswarm bridge`.

    Writes one layer_LLLL.onnx per MoE layer holding the chosen experts, its weights as
    external data (layer_LLLL.onnx.data, memory-mappable), the model's config.json and a
    manifest.json with SHA-256 hashes. Example:

    \b
        moeswarm export-onnx --model ./mixtral --layers 0-31 --experts 6-7 --out ./shards
    """
    from ..daemon import parse_range, span
    from ..model import load_config
    from .export import export_onnx as run

    from tqdm import tqdm

    cfg = load_config(model_dir)
    layer_range, expert_range = parse_range(layers, cfg.num_layers, "layers"), parse_range(experts, cfg.num_experts,
                                                                                           "experts")
    with tqdm(desc=f"exporting experts {span(expert_range)}", unit="layer", disable=quiet,
              dynamic_ncols=True) as bar:
        def on_layer(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        manifest = run(model_dir, out_dir, layers=layer_range, experts=expert_range, dtype=dtype, model_id=model_id,
                       on_layer=on_layer)
    click.echo(json.dumps({"out": out_dir, "model_id": manifest.model_id, "layers": list(manifest.layers),
                           "experts": list(manifest.experts), "moe_layers": list(manifest.moe_layers),
                           "dtype": manifest.dtype}))


@click.command()
@click.option("--relay", "relay_url", required=True, metavar="wss://HOST:PORT", help="The relay to dial out to.")
@click.option("--ca", "ca_file", type=click.Path(dir_okay=False, exists=True), default=None,
              help="Trust only this CA for the relay's certificate (default: the system trust store).")
@click.option("--shards", "shards_dir", default=None, type=click.Path(file_okay=False, exists=True),
              help="An export-onnx output folder to serve.")
@click.option("--layers", default=None, metavar="A-B", help="Serve only these layers of the shards.")
@click.option("--experts", default=None, metavar="X-Y|auto",
              help="Serve only these experts of the shards; 'auto' (with --model and --bootstrap, instead of "
                   "--shards) asks the swarm's market which experts it lacks and exports them.")
@click.option("--model", "model_dir", default=None, type=click.Path(file_okay=False, exists=True),
              help="With --experts auto: the checkpoint every peer of the swarm uses.")
@click.option("--bootstrap", multiple=True, metavar="MULTIADDR",
              help="With --experts auto: a swarm peer to read the market through (repeatable).")
@click.option("--capacity", default=None, metavar="SIZE",
              help="With --experts auto: memory for the exported experts, e.g. 2GB (default: half the free RAM).")
@click.option("--dtype", default="fp32", show_default=True, type=click.Choice(["fp32", "fp16"]),
              help="With --experts auto: export dtype (fp32 matches the engine to 1e-5, fp16 halves the bytes).")
@click.option("--shards-cache", default=None, type=click.Path(file_okay=False),
              help="With --experts auto: where exports are kept and reused [default: ~/.cache/moeswarm/shards].")
@click.option("--identity", "identity_file", type=click.Path(dir_okay=False), default=None,
              help="File holding this device's Ed25519 key (created if missing). Default: a new key each run.")
@click.option("--relay-peer", default=None, metavar="PEER_ID", help="Refuse a relay with another peer ID.")
@click.option("--threads", default=1, show_default=True, type=click.IntRange(1, 64), help="onnxruntime threads.")
@click.option("--mmap", is_flag=True, help="Memory-map the weights instead of copying them (less RAM, slower batches).")
@click.option("--max-backoff", default=30.0, show_default=True, help="Longest wait between reconnects, seconds.")
@click.option("--announce-interval", default=240.0, show_default=True, help="Re-announce this often, seconds.")
@click.option("--web", "web_listen", default=None, metavar="HOST:PORT",
              help="Instead of serving the shards from this process, serve the volunteer page (and the shards) "
                   "on HOST:PORT: phones that open it become the devices (see --web-cert).")
@click.option("--web-cert", type=click.Path(dir_okay=False, exists=True), default=None,
              help="With --web: TLS certificate (PEM) for the page; phones' browsers need https (WebCrypto).")
@click.option("--web-key", type=click.Path(dir_okay=False, exists=True), default=None, help="Its private key (PEM).")
@click.option("-v", "--verbose", count=True, help="More logging on stderr.")
@friendly_errors
def bridge(relay_url: str, ca_file: str | None, shards_dir: str | None, layers: str | None, experts: str | None,
           model_dir: str | None, bootstrap: tuple[str, ...], capacity: str | None, dtype: str,
           shards_cache: str | None, identity_file: str | None, relay_peer: str | None, threads: int, mmap: bool,
           max_backoff: float, announce_interval: float, web_listen: str | None, web_cert: str | None,
           web_key: str | None, verbose: int) -> None:
    """Serve ONNX expert shards from behind NAT, through a relay (this device never listens).

    Dials the relay over TLS, proves this device's identity, announces the shards' experts in
    the swarm through the relay, and answers expert calls with onnxruntime, signing receipts.
    Reconnects with jittered backoff when the relay goes away. Example:

    \b
        moeswarm bridge --relay wss://relay.example.org --shards ./shards --identity ~/.moeswarm/device.key

    Or let the swarm's market choose: the bridge joins the DHT briefly as a client, takes the
    block the market assigns an edge device of --capacity, exports it (or reuses an earlier
    export from --shards-cache) and serves it:

    \b
        moeswarm bridge --relay wss://relay.example.org --model ./mixtral --experts auto \\
            --capacity 2GB --bootstrap /ip4/203.0.113.5/tcp/4001/p2p/12D3KooW...

    Or let phones do the serving, for a private swarm: with --web the bridge serves the volunteer
    page and the shards, and every browser that opens https://HOST:PORT/volunteer/ dials the relay
    as a device and computes the experts with onnxruntime-web:

    \b
        moeswarm bridge --relay wss://relay.example.org --shards ./shards --web 0.0.0.0:8443 \\
            --web-cert cert.pem --web-key key.pem

    With --experts auto (and --model, --bootstrap, --capacity of one phone) the page serves the
    block the market assigns an edge device: the long tail.

    Prints `READY {json}` (peer_id, endpoint, layers, experts) once the relay has published it
    (with --web: the page's url).
    """
    from ..daemon import check_listen, run_daemon
    from ..errors import ConfigError
    from .bridge import BridgeConfig, run_bridge

    logging.basicConfig(level=logging.WARNING - 10 * min(verbose, 2), format="%(asctime)s %(name)s %(message)s")
    auto = experts == "auto"
    if auto and (shards_dir is not None or model_dir is None or layers is not None):
        raise ConfigError("--experts auto exports its own shards: give --model (and --bootstrap), "
                          "not --shards or --layers")
    if not auto and (shards_dir is None or model_dir is not None):
        raise ConfigError("give --shards DIR (an export-onnx folder), or --model DIR with --experts auto")

    if web_listen is not None:
        from .._cli_util import host_port
        from ..web.serve import WebConfig, serve_web

        host, port = host_port(web_listen, "--web")
        check_listen(host, port, "--web")

        async def web_main() -> None:
            folder = shards_dir
            if auto:  # the market's block for an edge device of --capacity (a phone): the long tail
                from ..model.memory import parse_size
                from .auto import AutoConfig, market_shards

                if capacity is None:
                    raise ConfigError("--web with --experts auto: give --capacity, what one phone holds (e.g. 200MB)")
                assert model_dir is not None  # checked above
                path, _ = await market_shards(AutoConfig(model_dir, bootstrap, parse_size(capacity), dtype=dtype,
                                                         cache_dir=shards_cache))
                folder = str(path)
            assert folder is not None  # checked above
            await serve_web(WebConfig(host, port, relay_url, folder, ca_file, web_cert, web_key))

        run_daemon(web_main())
        return

    async def main() -> None:
        folder = shards_dir
        if auto:
            from ..model.memory import parse_size
            from .auto import AutoConfig, market_shards

            assert model_dir is not None  # checked above
            path, _ = await market_shards(AutoConfig(model_dir, bootstrap, parse_size(capacity) if capacity else None,
                                                     dtype=dtype, cache_dir=shards_cache))
            folder = str(path)
        assert folder is not None  # checked above
        config = BridgeConfig(relay_url, folder, ca_file, identity_file, relay_peer, layers,
                              None if auto else experts, threads, mmap, announce_interval, max_backoff_s=max_backoff)
        await run_bridge(config)

    run_daemon(main())


_standalone = click.Group(commands={"bridge": bridge, "export-onnx": export_onnx},
                          help="moeswarm edge-device commands (until registered in `moeswarm`).")

if __name__ == "__main__":  # python -m moeswarm.mobile_bridge.cli bridge|export-onnx ...
    _standalone()
