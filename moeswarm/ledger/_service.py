"""The ingestion service: an aiohttp HTTP server in front of a ``Ledger``.

    POST /v1/receipts          body: msgpack {"receipts": [bin, ...]}, each a countersigned_receipt or (v1.3) batched_receipt
                               frame body; answer (JSON, after the commit): {"results": [...], "head": n}
    GET  /v1/accounts/{peer}   a peer's standing (JSON): {"peer", "balance", "paid", "receipts", "funded"};
                               ``?since_ms=`` counts paid calls from then (a node's ``--require-funded``)
    POST /v1/standing          JSON {"peers": [base58, ...] (at most 1024), "since_ms": t}: the standing of
                               each, {"standing": [...]} (the market weighs demand reports by ``paid``);
                               public like GET /v1/accounts, so bounded instead of authenticated: a body
                               of at most 96 KiB (413 before reading more), flat JSON only
    GET  /v1/standing          ?since_ms=t&limit=n (n <= 1024): the standing of the n clients that paid
                               the most since t, most first (whose demand reports the market reads)
    POST /v1/audits            body: an AuditSample (msgpack); re-executed here, evidence on mismatch; before
                               any work: body size (413), signatures, hashes, model limits, the judge's
                               work cap and a funded client (422)
    GET  /v1/proofs/{receipt}  inclusion proof (JSON)
    GET  /v1/settlements/{n}   signed settlement statement of epoch n (JSON)
    GET  /healthz              {"ok": true, "peer_id": ..., "entries": n}

Every route is bounded before it parses or computes (see ``protocol_spec/security.md``, "Bounds on
the HTTP services"), and every connection by ``net.http_guard`` (header, body and idle timeouts,
connections per address). Only the operator registers a model's shape (``moeswarm-ledger models add``): there is no HTTP
route for it. Database work runs in worker threads: signature checks of concurrent batches overlap (Ed25519
verification releases the GIL) while appends are serialised by the ledger.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from moeswarm.errors import (
    BadResponse,
    ConfigError,
    NetworkError,
    ProtocolError,
    SwarmError,
)
from moeswarm.net.http_guard import HttpLimits, guarded_runner, read_body, start_site
from moeswarm.protocol import DecodeLimits, peer_id_from_str, peer_id_to_str, unpack

from ._audit import AuditSample
from ._errors import LedgerCorrupt
from ._evidence import LocalJudge
from ._settlement import prove, stored_statement, top_contributors
from ._store import Ledger

log = logging.getLogger(__name__)
MSGPACK = "application/msgpack"


@dataclass(frozen=True)
class ServiceConfig:
    """Where the service listens and what it accepts."""

    host: str = "127.0.0.1"
    port: int = 0  # 0 picks a free port
    max_batch: int = 4096  # receipts per POST /v1/receipts
    max_body_bytes: int = 64 * 1024 * 1024  # largest request body
    max_standing_peers: int = 1024  # peers per POST /v1/standing
    max_standing_body: int = 96 * 1024  # bytes of a POST /v1/standing body (1024 base58 IDs are ~57 KiB)
    limits: HttpLimits = HttpLimits()  # header/body/idle timeouts and connections per address


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


class LedgerService:
    """``async with LedgerService(ledger) as service: ... service.url ...``"""

    def __init__(self, ledger: Ledger, config: ServiceConfig = ServiceConfig(), *,
                 judge: LocalJudge | None = None) -> None:
        self.ledger = ledger
        self.config = config
        self.judge = judge  # re-executes POST /v1/audits; None = audits are not offered
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes)
        app.add_routes([
            web.post("/v1/receipts", self._receipts),
            web.post("/v1/gateway-charges", self._gateway_charge),
            web.get("/v1/accounts/{peer}", self._account),
            web.post("/v1/standing", self._standing),
            web.get("/v1/standing", self._top_standing),
            web.post("/v1/audits", self._audit),
            web.get("/v1/proofs/{receipt_id}", self._proof),
            web.get("/v1/settlements/{epoch}", self._settlement),
            web.get("/v1/contributors", self._contributors),
            web.get("/healthz", self._health),
        ])
        return app

    async def start(self) -> None:
        self._runner = guarded_runner(self.app(), self.config.limits, access_log=None, handle_signals=False)
        await self._runner.setup()
        await start_site(self._runner, self.config.host, self.config.port, self.config.limits)
        self.port = int(self._runner.addresses[0][1])

    async def aclose(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> LedgerService:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ handlers

    async def _receipts(self, request: web.Request) -> web.Response:
        try:
            # bounded: a map of one array of bins, nothing else (a body of tiny nested objects
            # would otherwise cost 70x its size in Python objects)
            body = unpack(await request.read(), DecodeLimits(max_depth=2, max_array=self.config.max_batch,
                                                              max_map=8, max_str=256, max_bin=64 * 1024))
        except ProtocolError as e:
            return _error(400, f"body must be msgpack {{receipts: [bin, ...]}}: {e}")
        items = body.get("receipts") if isinstance(body, dict) else None
        if not isinstance(items, list):
            return _error(400, "body must be msgpack {receipts: [bin, ...]}")
        if len(items) > self.config.max_batch:
            return _error(413, f"at most {self.config.max_batch} receipts per request")
        batch = [item if isinstance(item, bytes) else b"" for item in items]  # b"": rejected as malformed
        try:
            results = await asyncio.to_thread(self.ledger.ingest, batch)
        except NetworkError as e:
            return _error(503, str(e))
        except LedgerCorrupt as e:
            return _error(500, str(e))
        head = max((r.position or 0 for r in results), default=0)
        return web.json_response({"results": [r.to_json() for r in results], "head": head})

    async def _gateway_charge(self, request: web.Request) -> web.Response:
        """msgpack ``{authorization: bin, usage: bin}`` -> JSON ``{status, charged, moved, message}``
        (``_authorizations.py``); 200 for every outcome, the status says which."""
        from ._authorizations import charge

        body = await read_body(request, 4096)  # two records of at most 1 KiB each
        try:
            fields = unpack(body, DecodeLimits(max_depth=1, max_array=0, max_map=2, max_str=32, max_bin=1024))
        except ProtocolError as e:
            return _error(400, f"body must be msgpack {{authorization: bin, usage: bin}}: {e}")
        auth = fields.get("authorization") if isinstance(fields, dict) else None
        usage = fields.get("usage") if isinstance(fields, dict) else None
        if not (isinstance(auth, bytes) and isinstance(usage, bytes)):
            return _error(400, "body must be msgpack {authorization: bin, usage: bin}")
        try:
            result = await asyncio.to_thread(charge, self.ledger, auth, usage)
        except NetworkError as e:
            return _error(503, str(e))
        except LedgerCorrupt as e:
            return _error(500, str(e))
        return web.json_response(result.to_json())

    async def _account(self, request: web.Request) -> web.Response:
        try:
            peer = peer_id_from_str(request.match_info["peer"])
            since = int(request.query.get("since_ms", "0"))
        except (SwarmError, ValueError):
            return _error(400, "give a base58 peer ID and an integer since_ms")
        try:
            standing = await asyncio.to_thread(self.ledger.standing, [peer], since)
        except SwarmError as e:
            return _error(503, str(e))
        return web.json_response(standing[peer].to_json())

    async def _standing(self, request: web.Request) -> web.Response:
        body = await read_body(request, self.config.max_standing_body)  # 413 before a byte more is read
        try:
            d = _flat_json(body)
            names = d["peers"]
            if not isinstance(names, list) or len(names) > self.config.max_standing_peers:
                raise ValueError
            if not all(isinstance(n, str) for n in names) or type(d.get("since_ms", 0)) is not int:
                raise TypeError
            peers = [peer_id_from_str(n) for n in names]
            since = int(d.get("since_ms", 0))
        except (ValueError, KeyError, TypeError, AttributeError, SwarmError):
            return _error(400, f'body must be JSON {{"peers": [base58, ...] (at most '
                               f'{self.config.max_standing_peers}), "since_ms": t}}')
        try:
            standing = await asyncio.to_thread(self.ledger.standing, peers, since)
        except SwarmError as e:
            return _error(503, str(e))
        return web.json_response({"standing": [standing[p].to_json() for p in dict.fromkeys(peers)]})

    async def _top_standing(self, request: web.Request) -> web.Response:
        try:
            since = int(request.query.get("since_ms", "0"))
            limit = int(request.query.get("limit", "256"))
            if not 1 <= limit <= self.config.max_standing_peers:
                raise ValueError
        except ValueError:
            return _error(400, f"since_ms is an integer, limit 1..{self.config.max_standing_peers}")

        def read() -> list[dict[str, Any]]:
            peers = self.ledger.top_payers(since, limit)
            standing = self.ledger.standing(peers, since)
            return [standing[p].to_json() for p in peers]

        try:
            top = await asyncio.to_thread(read)
        except SwarmError as e:
            return _error(503, str(e))
        return web.json_response({"standing": top})

    async def _audit(self, request: web.Request) -> web.Response:
        if self.judge is None:
            return _error(501, "this ledger holds no weights to audit with (serve --model-dir)")
        limit = min(self.config.max_body_bytes, self.judge.largest_sample())
        body = await read_body(request, limit)  # 413 before reading a sample larger than any auditable call
        try:
            sample = AuditSample.decode(body)
            verdict = await self.judge(sample)
        except (BadResponse, ProtocolError) as e:
            return _error(422, str(e))
        except ConfigError as e:
            return _error(400, str(e))
        except SwarmError as e:
            return _error(503, str(e))
        return web.json_response(verdict.to_json())

    async def _proof(self, request: web.Request) -> web.Response:
        try:
            proof = await asyncio.to_thread(prove, self.ledger, request.match_info["receipt_id"])
        except ConfigError as e:
            return _error(404, str(e))
        except SwarmError as e:
            return _error(503, str(e))
        return web.json_response(proof.to_json())

    async def _settlement(self, request: web.Request) -> web.Response:
        try:
            epoch = int(request.match_info["epoch"])
        except ValueError:
            return _error(400, "epoch must be an integer")
        try:
            statement = await asyncio.to_thread(stored_statement, self.ledger, epoch)
        except SwarmError as e:
            return _error(503, str(e))
        if statement is None:
            return _error(404, f"epoch {epoch} is not settled")
        return web.json_response(statement.to_json())

    async def _contributors(self, request: web.Request) -> web.Response:
        """Top servers by settled credit (``?top=N``, at most 1000): what the swarm map shows."""
        try:
            top = max(1, min(1000, int(request.query.get("top", "20"))))
        except ValueError:
            return _error(400, "top must be an integer")
        try:
            rows = await asyncio.to_thread(top_contributors, self.ledger, top)
        except SwarmError as e:
            return _error(503, str(e))
        return web.json_response({"contributors": [{"peer_id": peer_id_to_str(p), "credit": c} for p, c in rows]})

    async def _health(self, request: web.Request) -> web.Response:
        try:
            head = await asyncio.to_thread(self.ledger.head)
        except SwarmError as e:
            return _error(503, str(e))
        return web.json_response({"ok": True, "peer_id": peer_id_to_str(self.ledger.ledger_peer_id),
                                  "entries": head.position})


def _flat_json(body: bytes) -> Any:
    """JSON of at most two levels (an object of scalars and arrays of scalars): ``ValueError``
    before parsing anything nested deeper (a body of ``[[[[...`` builds no objects)."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in body:  # bounded by the route's body limit
        if in_string:
            escaped, in_string = (False, True) if escaped else (byte == 0x5C, byte != 0x22)
        elif byte == 0x22:
            in_string = True
        elif byte in b"[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > 2:
                raise ValueError("nested deeper than an object of arrays")
        elif byte in b"]}":
            depth -= 1
    return json.loads(body)


def ready_info(service: LedgerService) -> dict[str, Any]:
    """What ``moeswarm-ledger serve`` prints after ``READY``."""
    return {"peer_id": peer_id_to_str(service.ledger.ledger_peer_id), "url": service.url,
            "http": service.url, "db": repr(service.ledger)}
