"""The relay's limits: one frozen config, token buckets for rates, windows for quotas.

Pure bookkeeping with an injectable clock; the server decides what to do with the answers
(wait, or disconnect the peer).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import ConfigError
from ..protocol import DEFAULT_MAX_FRAME

Clock = Callable[[], float]


@dataclass(frozen=True)
class RelayLimits:
    """Operator limits. Rates are per second; 0 disables a rate or a quota."""

    max_devices: int = 10_000  # device sessions held at once
    max_streams: int = 50_000  # client streams open at once, all devices together
    max_streams_per_device: int = 256  # client streams open to one device
    max_streams_per_client: int = 64  # client streams open from one client address (IPv6: one /64)
    max_devices_per_ip: int = 16  # device connections (authenticated or not) from one address (IPv6: one /64)
    max_publish_layers: int = 256  # DHT keys one relay_publish may ask for (distinct layers of the record)
    preauth_bytes: int = 16 * 1024  # bytes a device may send before it has authenticated; more closes it
    max_frame: int = DEFAULT_MAX_FRAME  # largest data-plane frame body forwarded, bytes
    device_frames_per_s: float = 5_000.0  # frames a device may send (burst: one second's worth)
    device_bytes_per_s: float = 100e6  # bytes a device may send
    client_frames_per_s: float = 5_000.0  # frames one client address may send
    client_bytes_per_s: float = 100e6  # bytes one client address may send
    device_quota_bytes: int = 0  # bytes forwarded to and from one device per quota window
    client_quota_bytes: int = 0  # bytes forwarded to and from one client address per window
    quota_window_s: float = 86_400.0  # quota accounting period
    max_flood_s: float = 2.0  # a peer held at its frame-rate limit this long without a break is disconnected
    queue_bytes: int = 16 << 20  # per-session outbound queue bound (one frame may exceed it)
    queue_frames: int = 4096  # per-session outbound queue bound, frames
    idle_timeout_s: float = 300.0  # a client stream with no frame either way is closed
    heartbeat_s: float = 20.0  # WebSocket ping period; no pong within half of it closes
    handshake_timeout_s: float = 10.0  # a device must authenticate within this
    drain_timeout_s: float = 5.0  # graceful shutdown: wait this long for answers in flight
    startup_grace_s: float = 30.0  # after start, unknown devices get 503 (they are reconnecting)
    reconnect_grace_s: float = 30.0  # a device that left this recently gets 503, not 404

    def __post_init__(self) -> None:
        if self.max_frame < 1 << 20:
            raise ConfigError("max_frame must be at least 1 MiB (protocol_spec section 5)")
        for name in ("max_devices", "max_streams", "max_streams_per_device", "max_streams_per_client",
                     "max_devices_per_ip", "preauth_bytes", "max_publish_layers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1")
        if self.heartbeat_s <= 0 or self.idle_timeout_s <= 0 or self.max_flood_s < 0:
            raise ConfigError("heartbeat, idle timeout and flood limit must be positive")


class TokenBucket:
    """``rate`` tokens per second, holding at most ``burst``; ``take`` goes into debt.

    ``take(n)`` returns how long the caller should wait before going on (0 when it may go at
    once). A single take larger than the burst is allowed (a big frame), paid for by waiting.
    """

    def __init__(self, rate: float, burst: float, clock: Clock = time.monotonic) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self.tokens = burst
        self.stamp = clock()

    def take(self, n: float) -> float:
        if self.rate <= 0:
            return 0.0
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        self.tokens -= n
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate


class Quota:
    """Bytes per window; ``spend`` returns False once the window's allowance is used up."""

    def __init__(self, allowance: int, window_s: float, clock: Clock = time.monotonic) -> None:
        self.allowance, self.window_s, self.clock = allowance, window_s, clock
        self.used = 0
        self.window_start = clock()

    def spend(self, n: int) -> bool:
        if self.allowance <= 0:
            return True
        now = self.clock()
        if now - self.window_start >= self.window_s:
            self.window_start, self.used = now, 0
        self.used += n
        return self.used <= self.allowance


class PeerBudget:
    """The rate buckets and the quota of one device or one client address.

    Bytes over the rate are shaped: the sender is made to wait. Frames over the rate are shaped
    too, but a sender held at its frame limit for ``max_flood_s`` without a break is flooding
    and is refused, so it cannot occupy the relay indefinitely.
    """

    def __init__(self, frames_per_s: float, bytes_per_s: float, quota: int, limits: RelayLimits,
                 clock: Clock = time.monotonic) -> None:
        self.clock = clock
        self.frames = TokenBucket(frames_per_s, frames_per_s, clock)
        self.bytes = TokenBucket(bytes_per_s, bytes_per_s + limits.max_frame, clock)
        self.quota = Quota(quota, limits.quota_window_s, clock)
        self.max_flood_s = limits.max_flood_s
        self.flooding_since: float | None = None
        self.streams = 0  # open client streams counted against this peer

    def charge(self, nbytes: int) -> float | None:
        """Account one frame of ``nbytes`` sent by this peer: seconds to wait, or ``None`` when
        it is over its quota or has been flooding for ``max_flood_s``."""
        frame_wait = self.frames.take(1)
        byte_wait = self.bytes.take(nbytes)
        if not self.quota.spend(nbytes):
            return None
        if frame_wait <= 0:
            self.flooding_since = None
        elif self.flooding_since is None:
            self.flooding_since = self.clock()
        elif self.clock() - self.flooding_since > self.max_flood_s:
            return None
        return max(frame_wait, byte_wait)

    def account(self, nbytes: int) -> bool:
        """Bytes sent *to* this peer count against its quota only; False once it is used up."""
        return self.quota.spend(nbytes)


def device_budget(limits: RelayLimits, clock: Clock = time.monotonic) -> PeerBudget:
    return PeerBudget(limits.device_frames_per_s, limits.device_bytes_per_s, limits.device_quota_bytes, limits, clock)


def client_budget(limits: RelayLimits, clock: Clock = time.monotonic) -> PeerBudget:
    return PeerBudget(limits.client_frames_per_s, limits.client_bytes_per_s, limits.client_quota_bytes, limits, clock)
