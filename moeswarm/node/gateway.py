"""``moeswarm backbone --gateway``: announce this backbone's API to the swarm as a gateway.

Every ``interval_s`` (and at once when started) the backbone signs a ``GatewayRecord``
(``moeswarm.net.gateways``): its API URL, the model it serves, the free places in its batch, its
price per token and the median round trip it measured to the holders it calls; it stores it under
its own key and provides the gateway key. On exit the record is replaced by one that expires at
once, so clients stop choosing it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._tasks import cancel_and_wait
from ..errors import SwarmError
from ..net.gateways import (
    GATEWAY_PROVIDER_KEY,
    GatewayRecord,
    gateway_key,
    sign_gateway,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatewayConfig:
    url: str  # the API URL announced (what people dial), e.g. http://203.0.113.5:8000
    price_per_token: int = 0  # credits per generated token a person pays this gateway (0: free)
    interval_s: float = 10.0  # re-announce (free slots, round trip) this often
    ttl_s: float = 60.0  # records expire this long after each announcement


class GatewayAnnouncer:
    """Owns the refresh task; ``start`` publishes once before returning."""

    def __init__(self, dht: Any, identity: Any, model_id: str, config: GatewayConfig, max_batch: int,
                 running: Callable[[], int], rtt_s: Callable[[], list[float]]) -> None:
        self.dht, self.identity, self.model_id, self.config = dht, identity, model_id, config
        self.max_batch, self.running, self.rtt_s = max_batch, running, rtt_s
        self._seq = int(time.time() * 1000)
        self._task: asyncio.Task[None] | None = None
        self.last: GatewayRecord | None = None

    def record(self, ttl_s: float) -> GatewayRecord:
        self._seq += 1
        rtts = self.rtt_s()
        return sign_gateway(self.identity, self.config.url, [self.model_id],
                            free_slots=max(0, self.max_batch - self.running()), max_batch=self.max_batch,
                            price_per_token=self.config.price_per_token,
                            rtt_us=int(statistics.median(rtts) * 1e6) if rtts else 0, seq=self._seq,
                            expires_at_ms=int((time.time() + ttl_s) * 1000))

    async def publish(self, ttl_s: float | None = None, *, provide: bool = True) -> None:
        record = self.record(self.config.ttl_s if ttl_s is None else ttl_s)
        await self.dht.put(gateway_key(self.identity.peer_id), record.encode())
        if provide:
            await self.dht.provide(GATEWAY_PROVIDER_KEY)
        self.last = record

    async def start(self) -> None:
        await self.publish()
        self._task = asyncio.create_task(self._refresh())

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                await self.publish()
            except SwarmError as e:
                log.warning("gateway announcement failed: %s", e)

    async def aclose(self) -> None:
        """Stop refreshing and replace the record with one that expires at once."""
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        with contextlib.suppress(SwarmError, TimeoutError):
            async with asyncio.timeout(5):
                await self.publish(ttl_s=1.0, provide=False)


def holder_rtts(backbone: Any) -> Callable[[], list[float]]:
    """Round trips (seconds) the backbone's link monitor measured to the holders it calls."""

    def rtts() -> list[float]:
        tiers = backbone.tiers
        links = getattr(getattr(tiers, "links", None), "links", {}) if tiers is not None else {}
        return [est.rtt_s for est in links.values()]

    return rtts


class SpendingGate:
    """A priced gateway's door (``--gateway-price`` > 0 with ``--ledger``): every generation request
    carries the person's spending authorization for this gateway, model and announced price, and
    an acknowledgement of every token streamed to them under it before (``moeswarm.sdk.spending``);
    a request for more tokens than the authorization has left is refused. Each acknowledgement
    goes to the ledger as a charge (``POST /v1/gateway-charges``), which moves the credits. A person
    who stops acknowledging gets nothing more: the gateway risks one request's tokens at most."""

    def __init__(self, identity: Any, model_id: str, price_per_token: int, ledger_url: str,
                 max_tokens_default: int) -> None:
        self.identity, self.model_id, self.price = identity, model_id, price_per_token
        self.ledger_url, self.max_tokens_default = ledger_url.rstrip("/"), max_tokens_default
        self.streamed: dict[bytes, int] = {}  # tokens streamed, by authorization id
        self.acked: dict[bytes, int] = {}  # tokens acknowledged, by authorization id
        self.charges: list[dict[str, Any]] = []  # the ledger's answers, newest last (status page, tests)
        self._session: Any = None

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()

    def middleware(self) -> Any:
        from aiohttp import web

        from .http_api import METER, ApiError

        @web.middleware
        async def gate(request: web.Request, handler: Any) -> web.StreamResponse:
            paid = request.method == "POST" and request.path in ("/v1/completions", "/v1/chat/completions")
            if request.path == "/v1/gateway/usage" and request.method == "POST":
                auth, acked = await self._admit(request, ApiError)
                return web.json_response({"acknowledged": acked})
            if not paid:
                return await handler(request)
            auth, acked = await self._admit(request, ApiError)
            if acked < self.streamed.get(auth.id, 0):
                raise ApiError(402, f"acknowledge the {self.streamed[auth.id]} tokens streamed under this "
                               f"authorization first ({acked} acknowledged)", code="unacknowledged_tokens")
            body = await request.json() if request.can_read_body else {}
            wanted = body.get("max_tokens") if isinstance(body, dict) else None
            wanted = wanted if isinstance(wanted, int) else self.max_tokens_default
            left = auth.max_credits // max(self.price, 1) - self.streamed.get(auth.id, 0)
            if wanted > left:
                raise ApiError(402, f"the authorization pays for {left} more tokens, the request asks for {wanted}",
                               code="authorization_exhausted")

            def meter(n: int) -> None:
                self.streamed[auth.id] = self.streamed.get(auth.id, 0) + n

            request[METER] = meter
            return await handler(request)

        return gate

    async def _admit(self, request: Any, error: Any) -> tuple[Any, int]:
        """The request's checked authorization, and the tokens acknowledged under it (its usage sent on)."""
        from ..errors import ProtocolError
        from ..protocol._spending import SpendingAuthorization, UsageAck, check_spending
        from ..sdk.spending import AUTHORIZATION_HEADER, USAGE_HEADER, unb64

        raw = request.headers.get(AUTHORIZATION_HEADER)
        if raw is None:
            raise error(402, f"this gateway charges {self.price} credits per token: send a spending authorization "
                        f"({AUTHORIZATION_HEADER})", code="payment_required")
        try:
            auth = SpendingAuthorization.decode(unb64(raw))
            usage = USAGE_HEADER in request.headers and UsageAck.decode(unb64(request.headers[USAGE_HEADER])) or None
            check_spending(auth, usage)
        except (ProtocolError, ValueError) as e:
            raise error(402, f"bad spending authorization: {e}", code="bad_authorization") from None
        if auth.gateway != self.identity.peer_id or auth.model_id != self.model_id or auth.price_per_token != self.price:
            raise error(402, "the authorization is for another gateway, model or price", code="bad_authorization")
        if auth.expires_ms <= time.time() * 1000:
            raise error(402, "the authorization has expired", code="bad_authorization")
        if usage is not None and usage.tokens > self.acked.get(auth.id, 0):
            status = await self._charge(auth, usage)
            if status not in ("charged", "duplicate"):  # unpaid: serve nothing more under it
                raise error(402, f"the ledger did not take the charge ({status})", code="charge_refused")
            self.acked[auth.id] = usage.tokens
        return auth, self.acked.get(auth.id, 0)

    async def _charge(self, auth: Any, usage: Any) -> str:
        """The ledger's status for this charge (``unreachable`` when it did not answer)."""
        import aiohttp

        from ..protocol import canonical

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        try:
            async with self._session.post(self.ledger_url + "/v1/gateway-charges",
                                          data=canonical({"authorization": auth.encode(), "usage": usage.encode()}),
                                          headers={"Content-Type": "application/msgpack"}) as response:
                answer = await response.json()
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as e:
            log.warning("the ledger did not take a charge: %s", e)
            return "unreachable"
        self.charges.append(answer)
        return str(answer.get("status")) if isinstance(answer, dict) else "unreadable"
