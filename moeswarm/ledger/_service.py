"""The ingestion service: an aiohttp HTTP server in front of a ``Ledger``.

    POST /v1/receipts          body: msgpack {"receipts": [bin, ...]}, each a countersigned_receipt
                               frame body; answer (JSON, after the commit): {"results": [...], "head": n}
    PUT  /v1/models/{model_id} JSON {"hidden": H, "ffn": F}: a backbone registers its model's expert
                               shape for the FLOPs bound (first registration wins; 409 on conflict)
    POST /v1/audits            body: an AuditSample (msgpack); re-executed here, evidence on mismatch
    GET  /v1/proofs/{receipt}  inclusion proof (JSON)
    GET  /v1/settlements/{n}   signed settlement statement of epoch n (JSON)
    GET  /healthz              {"ok": true, "peer_id": ..., "entries": n}

Database work runs in worker threads: signature checks of concurrent batches overlap (Ed25519
verification releases the GIL) while appends are serialised by the ledger.
"""

from __future__ import annotations

import asyncio
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
from moeswarm.protocol import DecodeLimits, peer_id_to_str, unpack

from ._audit import AuditSample
from ._chain import ModelShape
from ._errors import LedgerCorrupt
from ._evidence import LocalJudge
from ._settlement import prove, stored_statement
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
    accept_client_models: bool = True  # backbones may register unknown models' expert shapes


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
            web.put("/v1/models/{model_id:.+}", self._model),
            web.post("/v1/audits", self._audit),
            web.get("/v1/proofs/{receipt_id}", self._proof),
            web.get("/v1/settlements/{epoch}", self._settlement),
            web.get("/healthz", self._health),
        ])
        return app

    async def start(self) -> None:
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.config.host, self.config.port).start()
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

    async def _model(self, request: web.Request) -> web.Response:
        if not self.config.accept_client_models:
            return _error(403, "this ledger only knows the models its operator registered")
        try:
            d = await request.json()
            shape = ModelShape(int(d["hidden"]), int(d["ffn"]))
        except (ValueError, KeyError, TypeError):
            return _error(400, 'body must be JSON {"hidden": H, "ffn": F}')
        model_id = request.match_info["model_id"]
        try:
            created = await asyncio.to_thread(self.ledger.register_model, model_id, shape, "client")
        except ConfigError as e:
            return _error(409, str(e))
        except NetworkError as e:
            return _error(503, str(e))
        return web.json_response({"model_id": model_id, "created": created})

    async def _audit(self, request: web.Request) -> web.Response:
        if self.judge is None:
            return _error(501, "this ledger holds no weights to audit with (serve --model-dir)")
        try:
            sample = AuditSample.decode(await request.read())
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

    async def _health(self, request: web.Request) -> web.Response:
        try:
            head = await asyncio.to_thread(self.ledger.head)
        except SwarmError as e:
            return _error(503, str(e))
        return web.json_response({"ok": True, "peer_id": peer_id_to_str(self.ledger.ledger_peer_id),
                                  "entries": head.position})


def ready_info(service: LedgerService) -> dict[str, Any]:
    """What ``moeswarm-ledger serve`` prints after ``READY``."""
    return {"peer_id": peer_id_to_str(service.ledger.ledger_peer_id), "url": service.url,
            "http": service.url, "db": repr(service.ledger)}
