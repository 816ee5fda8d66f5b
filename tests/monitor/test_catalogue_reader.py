"""The catalogue reader's bounds and checks (``moeswarm.net.catalogue``), and ``config_request`` on a
real TLS data plane.

The reader is fed through a dictionary DHT (what ``P2PNode`` returns for ``find_providers`` and
``get``): the records are real signed entries from many keys, as strangers would publish them;
the real-process path is ``test_catalogue.py``.
"""

from __future__ import annotations

import asyncio
import hashlib
import time

import pytest

from moeswarm.errors import ProtocolError
from moeswarm.net.catalogue import (
    CATALOGUE_PROVIDER_KEY,
    CatalogueEntry,
    CatalogueModel,
    catalogue_key,
    read_catalogue,
    resolve_models,
    sign_catalogue_entry,
)
from moeswarm.net.client import ExpertClient, fetch_config
from moeswarm.net.dataplane import DataPlaneServer
from moeswarm.protocol import ErrorCode, Identity


class DictDHT:
    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.providers: list[str] = []
        self.asked: list[int] = []

    async def find_providers(self, key: str, limit: int = 20) -> list[str]:
        assert key == CATALOGUE_PROVIDER_KEY
        self.asked.append(limit)
        return self.providers[:limit]

    async def get(self, key: str) -> bytes | None:
        return self.values.get(key)

    def publish(self, ident: Identity, models: list[CatalogueModel], value: bytes | None = None) -> CatalogueEntry:
        entry = sign_catalogue_entry(ident, models, ["tcp+tls://127.0.0.1:1"], seq=1,
                                     expires_at_ms=int(time.time() * 1000) + 60_000)
        self.values[catalogue_key(ident.peer_id)] = entry.encode() if value is None else value
        self.providers.append(ident.peer_id_str)
        return entry


def model(config: bytes, name: str = "", model_id: str | None = None) -> CatalogueModel:
    digest = hashlib.sha256(config).digest()
    return CatalogueModel(model_id or f"mixtral-{digest.hex()[:12]}", digest, name)


def test_the_reader_is_bounded_and_drops_what_fails_a_check() -> None:
    dht = DictDHT()
    honest = model(b'{"a": 1}', "honest")
    for _ in range(2):
        dht.publish(Identity.generate(), [honest])
    # a stranger whose entry is signed by another key than the one its key names
    forger, victim = Identity.generate(), Identity.generate()
    forged = sign_catalogue_entry(forger, [honest], ["tcp+tls://127.0.0.1:1"], seq=1,
                                  expires_at_ms=int(time.time() * 1000) + 60_000).encode()
    dht.publish(victim, [honest], forged)
    dht.publish(Identity.generate(), [honest], b"junk")
    dht.publish(Identity.generate(), [model(b'{"b": 2}', model_id="mixtral-000000000000")])  # id/digest disagree
    # a chosen id published with two digests: the one more holders publish wins
    chosen_a, chosen_b = model(b'{"c": 3}', model_id="my-model"), model(b'{"d": 4}', model_id="my-model")
    for m in (chosen_a, chosen_a, chosen_b):
        dht.publish(Identity.generate(), [m])
    # 40 strangers with a model each: only MAX_CATALOGUE_MODELS (here 8) ids are kept
    for i in range(40):
        dht.publish(Identity.generate(), [model(f'{{"junk": {i}}}'.encode())])
    catalogue = asyncio.run(read_catalogue(dht, max_peers=30, max_models=8))
    assert dht.asked == [30]  # at most 30 providers asked for, and so read
    assert catalogue.offers[honest.model_id].config_digest == honest.config_digest
    assert len(catalogue.offers[honest.model_id].holders) == 2
    assert catalogue.offers["my-model"].config_digest == chosen_a.config_digest
    assert len(catalogue.offers) == 8
    # 30 providers read: 2 honest, 2 invalid, 1 misnamed, 3 my-model (one a minority), 22 junk of which 6 kept
    assert catalogue.rejected == {"invalid_entry": 2, "digest_not_id": 1, "digest_minority": 1,
                                  "too_many_models": 16}


def test_a_config_is_kept_only_if_it_hashes_to_the_digest() -> None:
    dht = DictDHT()
    config = b'{"model_type": "mixtral"}'
    liar, honest = Identity.generate(), Identity.generate()
    dht.publish(liar, [model(config)])
    dht.publish(honest, [model(config)])
    served = {liar.peer_id: b'{"model_type": "mixtral", "num_local_experts": 64}', honest.peer_id: config}
    asked: list[bytes] = []

    async def fetch(entry: CatalogueEntry, model_id: str) -> bytes:
        asked.append(entry.peer_id)
        return served[entry.peer_id]

    async def run() -> tuple[list, dict[str, int]]:
        catalogue = await read_catalogue(dht)
        return await resolve_models(catalogue, fetch), catalogue.rejected

    found, rejected = asyncio.run(run())
    assert asked == [liar.peer_id, honest.peer_id]  # the liar answered first and was refused
    assert [m.config for m in found] == [config] and rejected == {"config_mismatch": 1}


def test_config_request_over_a_real_tls_data_plane() -> None:
    server_id, client_id = Identity.generate(), Identity.generate()
    config = b'{"model_type": "mixtral"}'

    async def refuse(client: bytes, request: object) -> object:
        raise ProtocolError("no experts", code=ErrorCode.UNKNOWN_EXPERT)

    async def run() -> tuple[bytes, int, list[bytes]]:
        async with DataPlaneServer(server_id, refuse, configs={"m-1": config}) as plane:
            got = await fetch_config(client_id, server_id.peer_id, [plane.endpoint], "m-1", timeout=10)
            with pytest.raises(ProtocolError) as info:
                await fetch_config(client_id, server_id.peer_id, [plane.endpoint], "m-2", timeout=10)
            # one connection keeps serving after config requests (a ping too)
            client = await ExpertClient.connect(plane.endpoint, client_id, expected_peer=server_id.peer_id)
            try:
                again = [await client.config("m-1", 10) for _ in range(3)]
                assert await client.ping(timeout=10) > 0
            finally:
                await client.aclose()
        return got, info.value.code, again

    got, code, again = asyncio.run(run())
    assert got == config and code == ErrorCode.UNKNOWN_EXPERT and again == [config] * 3
