"""``moeswarm relay``: run a port-443 relay for devices that cannot accept connections."""

from __future__ import annotations

import logging

import click

from .._cli_util import friendly_errors, host_port
from ..daemon import check_listen, run_daemon


@click.command()
@click.option("--listen", default="0.0.0.0:443", show_default=True, metavar="HOST:PORT",
              help="Address for devices, clients, /healthz and /metrics (port 0: any free port).")
@click.option("--cert", "cert_file", type=click.Path(dir_okay=False), default=None,
              help="TLS certificate chain (PEM), e.g. /etc/letsencrypt/live/NAME/fullchain.pem.")
@click.option("--key", "key_file", type=click.Path(dir_okay=False), default=None,
              help="Its private key (PEM). Without --cert/--key the relay speaks plain ws:// (behind a TLS proxy).")
@click.option("--public-url", default=None, metavar="wss://NAME:PORT",
              help="How devices and clients reach this relay (required when --listen is a wildcard address).")
@click.option("--binding-cert", type=click.Path(dir_okay=False, exists=True), default=None,
              help="Behind a TLS-terminating proxy: the certificate the proxy presents (devices bind their login to it).")
@click.option("--bootstrap", multiple=True, metavar="MULTIADDR",
              help="A swarm peer to join the DHT through (repeatable); without it this relay is a bootstrap peer.")
@click.option("--p2p-listen", default=None, metavar="MULTIADDR",
              help="libp2p listen address (default: /ip4/0.0.0.0/tcp/4001; loopback relays: a free loopback port).")
@click.option("--identity", "identity_file", type=click.Path(dir_okay=False), default=None,
              help="File holding the relay's Ed25519 key (created if missing). Default: a new key each run.")
@click.option("--no-dht", is_flag=True, help="Do not join the DHT (benchmarks, private deployments).")
@click.option("--max-devices", default=10_000, show_default=True, type=click.IntRange(1))
@click.option("--max-streams", default=50_000, show_default=True, type=click.IntRange(1),
              help="Client streams open at once, all devices together.")
@click.option("--max-streams-per-device", default=256, show_default=True, type=click.IntRange(1))
@click.option("--max-streams-per-client", default=64, show_default=True, type=click.IntRange(1),
              help="Client streams open from one IP address.")
@click.option("--max-devices-per-ip", default=16, show_default=True, type=click.IntRange(1),
              help="Device connections (authenticated or not) from one IPv4 address or IPv6 /64.")
@click.option("--max-publish-layers", default=256, show_default=True, type=click.IntRange(1),
              help="DHT keys one device announcement may ask the relay to write.")
@click.option("--max-frame-mb", default=64.0, show_default=True, type=click.FloatRange(1),
              help="Largest data-plane frame forwarded, MiB.")
@click.option("--device-rate", default=5000.0, show_default=True, help="Frames per second one device may send.")
@click.option("--device-mbps", default=100.0, show_default=True, help="MB per second one device may send.")
@click.option("--client-rate", default=5000.0, show_default=True, help="Frames per second one client address may send.")
@click.option("--client-mbps", default=100.0, show_default=True, help="MB per second one client address may send.")
@click.option("--device-quota-gb", default=0.0, show_default=True, help="GB to and from one device per quota window (0: none).")
@click.option("--client-quota-gb", default=0.0, show_default=True, help="GB to and from one client address per window (0: none).")
@click.option("--quota-window-h", default=24.0, show_default=True, help="Quota window, hours.")
@click.option("--idle-timeout", default=300.0, show_default=True, help="Close client streams silent this many seconds.")
@click.option("--heartbeat", default=20.0, show_default=True, help="WebSocket ping period, seconds.")
@click.option("--drain-timeout", default=5.0, show_default=True, help="On shutdown, wait this long for answers in flight.")
@click.option("--volunteer-shards", type=click.Path(file_okay=False, exists=True), default=None,
              help="An export-onnx folder that browsers opening /volunteer/ download and serve.")
@click.option("--volunteer-shards-url", default=None, metavar="URL",
              help="Or the URL of one on another HTTP server (it must allow CORS from this relay).")
@click.option("-v", "--verbose", count=True, help="More logging on stderr.")
@friendly_errors
def relay(listen: str, cert_file: str | None, key_file: str | None, public_url: str | None, binding_cert: str | None,
          bootstrap: tuple[str, ...],
          p2p_listen: str | None, identity_file: str | None, no_dht: bool, max_devices: int, max_streams: int,
          max_streams_per_device: int, max_streams_per_client: int, max_devices_per_ip: int,
          max_publish_layers: int, max_frame_mb: float, device_rate: float,
          device_mbps: float, client_rate: float, client_mbps: float, device_quota_gb: float, client_quota_gb: float,
          quota_window_h: float, idle_timeout: float, heartbeat: float, drain_timeout: float,
          volunteer_shards: str | None, volunteer_shards_url: str | None, verbose: int) -> None:
    """Relay expert calls to devices behind NAT (phones, edge boxes) over TLS WebSockets.

    Devices dial out to wss://NAME/device, prove their Ed25519 identity and hold a session; the
    relay stores their signed announcements in the DHT and forwards data-plane frames between
    them and backbones, which reach a device at wss://NAME/<device peer id>. Example:

    \b
        moeswarm relay --listen 0.0.0.0:443 --public-url wss://relay.example.org \\
            --cert /etc/letsencrypt/live/relay.example.org/fullchain.pem \\
            --key /etc/letsencrypt/live/relay.example.org/privkey.pem --bootstrap /ip4/.../p2p/12D3Koo...

    A phone volunteers by opening https://NAME/volunteer/ (with --volunteer-shards).

    Prints `READY {json}` (url, peer_id, multiaddrs, port) on stdout once serving. SIGTERM drains
    (devices are told to reconnect), SIGHUP reloads the certificate files.
    """
    from ._limits import RelayLimits
    from ._server import RelayConfig
    from .daemon import RelayDaemonConfig, run_relay

    logging.basicConfig(level=logging.WARNING - 10 * min(verbose, 2), format="%(asctime)s %(name)s %(message)s")
    host, port = host_port(listen)
    limits = RelayLimits(
        max_devices=max_devices, max_streams=max_streams, max_streams_per_device=max_streams_per_device,
        max_streams_per_client=max_streams_per_client, max_devices_per_ip=max_devices_per_ip,
        max_publish_layers=max_publish_layers, max_frame=int(max_frame_mb * (1 << 20)),
        device_frames_per_s=device_rate, device_bytes_per_s=device_mbps * 1e6, client_frames_per_s=client_rate,
        client_bytes_per_s=client_mbps * 1e6, device_quota_bytes=int(device_quota_gb * 1e9),
        client_quota_bytes=int(client_quota_gb * 1e9), quota_window_s=quota_window_h * 3600,
        idle_timeout_s=idle_timeout, heartbeat_s=heartbeat, drain_timeout_s=drain_timeout,
    )
    config = RelayDaemonConfig(RelayConfig(host, port, cert_file, key_file, public_url, binding_cert, limits,
                                                           volunteer_shards, volunteer_shards_url),
                               tuple(bootstrap), p2p_listen, identity_file, dht=not no_dht)
    check_listen(host, port, "--listen")
    run_daemon(run_relay(config))


if __name__ == "__main__":  # python -m moeswarm.relay.cli, until the lead registers the command
    relay()
