"""Prometheus metrics of one relay, in a registry of its own (several relays may share a process)."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

ERROR_KINDS = ("malformed", "too_large", "text_message", "auth_failed", "rate_limited", "quota", "slow_consumer",
               "no_device", "session_limit", "idle", "publish_rejected", "unknown_stream")


class RelayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.devices = Gauge("moeswarm_relay_devices", "Authenticated device sessions held", registry=r)
        self.streams = Gauge("moeswarm_relay_streams", "Client streams open", registry=r)
        self.sessions = Counter("moeswarm_relay_sessions", "Sessions accepted", ["role"], registry=r)
        self.bytes = Counter("moeswarm_relay_forwarded_bytes", "Data-plane bytes forwarded (frames incl. "
                             "their length prefix)", ["direction"], registry=r)
        self.frames = Counter("moeswarm_relay_forwarded_frames", "Data-plane frames forwarded",
                              ["direction"], registry=r)
        self.calls = Counter("moeswarm_relay_calls", "Client frames answered by the device (request/response "
                             "pairs; handshake and pings included)", registry=r)
        self.errors = Counter("moeswarm_relay_errors", "Peers refused, throttled or disconnected, by cause",
                              ["kind"], registry=r)
        self.throttled = Counter("moeswarm_relay_throttled_seconds", "Time peers were held back by rate limits",
                                 ["role"], registry=r)
        self.published = Counter("moeswarm_relay_published_records", "Device announcements stored in the DHT",
                                 registry=r)
        self.latency = Histogram(
            "moeswarm_relay_round_trip_seconds",
            "Client frame in -> device answer out, as seen by the relay (includes device compute)",
            buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 10),
            registry=r,
        )
        for kind in ERROR_KINDS:
            self.errors.labels(kind)
        for direction in ("to_device", "to_client"):
            self.bytes.labels(direction)
            self.frames.labels(direction)

    def error(self, kind: str) -> None:
        self.errors.labels(kind).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
