"""``FundedGate``: a volunteer asks the ledger whether a client can pay before serving it.

``moeswarm node --require-funded URL`` wraps its expert handler in one. A client whose ledger
balance is zero gets an ``AUTH_FAILED`` error instead of work, since the ledger would refuse the
receipts of that work (``insufficient_funds``) and the volunteer would serve for nothing. Answers
are cached for ``ttl_s``; while the ledger cannot be reached the gate refuses (it fails closed).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import aiohttp

from moeswarm.errors import ProtocolError
from moeswarm.protocol import ErrorCode, peer_id_to_str

Req = TypeVar("Req")
Resp = TypeVar("Resp")


@dataclass(frozen=True)
class GateConfig:
    """How a volunteer checks its clients' standing."""

    ttl_s: float = 30.0  # trust a ledger answer this long, seconds
    timeout_s: float = 5.0  # one question to the ledger, seconds
    min_balance: int = 1  # credits a client must hold to be served


class FundedGate:
    """Serve a client only while the ledger at ``url`` says it holds ``min_balance`` credits."""

    def __init__(self, url: str, config: GateConfig = GateConfig()) -> None:
        self.url = url.rstrip("/")
        self.config = config
        self._cache: dict[bytes, tuple[float, bool]] = {}
        self._session: aiohttp.ClientSession | None = None
        self.refused = 0  # calls refused for want of credit (or of an answer)

    async def funded(self, client: bytes) -> bool:
        now = time.monotonic()
        held = self._cache.get(client)
        if held is not None and now - held[0] < self.config.ttl_s:
            return held[1]
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.config.timeout_s))
        try:
            async with self._session.get(f"{self.url}/v1/accounts/{peer_id_to_str(client)}") as resp:
                answer = await resp.json() if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            answer = None
        if answer is None:
            return False  # no answer: not cached, asked again next call
        ok = isinstance(answer.get("balance"), int) and answer["balance"] >= self.config.min_balance
        if len(self._cache) > 100_000:
            self._cache.clear()
        self._cache[client] = (now, ok)
        return ok

    def wrap(self, handler: Callable[[bytes, Req], Awaitable[Resp]]) -> Callable[[bytes, Req], Awaitable[Resp]]:
        """``handler`` behind the gate: unfunded clients get ``AUTH_FAILED`` before any work."""

        async def gated(client: bytes, request: Req) -> Resp:
            if not await self.funded(client):
                self.refused += 1
                raise ProtocolError(f"client {peer_id_to_str(client)} holds no credit at the ledger {self.url}",
                                    code=ErrorCode.AUTH_FAILED)
            return await handler(client, request)

        return gated

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        await asyncio.sleep(0)
