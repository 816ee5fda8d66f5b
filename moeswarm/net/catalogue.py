"""What a swarm serves: the catalogue, one signed DHT record per serving peer, readable by anyone who joins.

Every node that announces experts also writes::

    /moeswarm/v1/catalogue/<peer id, base58btc>

    {type: "catalogue_entry", peer_id, public_key, endpoints, seq, expires_at_ms,
     models: [{model_id, config_digest: SHA-256 of the config bytes the model id hashes, name}],
     sig: the peer's Ed25519 signature (kind ``catalogue``) over canonical(the map without sig)}

and registers as a provider of ``/moeswarm/v1/catalogue``. A reader (``read_catalogue``) finds at
most ``MAX_CATALOGUE_PEERS`` providers, reads and validates each one's record, and keeps at most
``MAX_CATALOGUE_MODELS`` model ids; ``resolve_models`` then fetches each model's config from one of
its holders over the data plane (``config_request``) and keeps it only if its SHA-256 equals the
published digest (and, for a derived model id such as ``mixtral-76b2c92d8168``, the id's 12 hex
digits are the digest's). Whatever fails a check is dropped and counted, never shown.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final

from ..errors import SwarmError
from ..protocol import (
    ErrorCode,
    Identity,
    canonical,
    is_peer_id,
    peer_id_from_public_key,
    peer_id_from_str,
    peer_id_to_str,
    verify,
)
from ..protocol._codec import ENDPOINT_RE, MODEL_ID_RE
from ..protocol._limits import (
    MAX_ENDPOINT_BYTES,
    MAX_ENDPOINTS,
    MAX_MODEL_ID_BYTES,
    MAX_RECORD_BYTES,
    PUBLIC_KEY_SIZE,
    SIGNATURE_SIZE,
)
from ..protocol._wire import Fields, bad, check_text, unpack
from ._signed import select_newest, validate_peer_record

log = logging.getLogger(__name__)

CATALOGUE_KIND: Final = "catalogue"
"""Signature domain of catalogue entries (after the protocol's ``moeswarm/v1/`` prefix)."""
CATALOGUE_PROVIDER_KEY: Final = "/moeswarm/v1/catalogue"
"""Every peer with a catalogue entry provides this key."""
MAX_MODELS_PER_ENTRY: Final = 8
"""Models one peer's entry may list."""
MAX_NAME_BYTES: Final = 64
MAX_CATALOGUE_PEERS: Final = 64
"""Providers of the catalogue key a reader asks for and reads in one pass."""
MAX_CATALOGUE_MODELS: Final = 32
"""Distinct model ids a reader keeps from one pass; further ones are dropped and counted."""
PARALLEL_GETS: Final = 8
"""DHT gets of catalogue entries in flight at once (each is a lookup of its own)."""
CONFIG_TRIES: Final = 3
"""Holders asked for a model's config before the model is given up for this pass."""
_KEY = re.compile(r"/moeswarm/v1/catalogue/([1-9A-HJ-NP-Za-km-z]+)")
_NAME = re.compile(r"[^\x00-\x1f\x7f]*")


@dataclass(frozen=True)
class CatalogueModel:
    """One model a peer serves, as its catalogue entry names it."""

    model_id: str
    config_digest: bytes  # SHA-256 of the config bytes the model id hashes (``model_id.config_bytes``)
    name: str = ""  # what a person calls it (config.json's ``name``/``_name_or_path``, or the folder's)

    def wire(self) -> dict[str, Any]:
        return {"config_digest": self.config_digest, "model_id": self.model_id, "name": self.name}


@dataclass(frozen=True)
class CatalogueEntry:
    """A peer's signed statement of the models it serves and where."""

    peer_id: bytes
    public_key: bytes
    models: tuple[CatalogueModel, ...]
    endpoints: tuple[str, ...]
    seq: int
    expires_at_ms: int
    sig: bytes = b""

    def body(self) -> dict[str, Any]:
        return {"endpoints": list(self.endpoints), "expires_at_ms": self.expires_at_ms,
                "models": [m.wire() for m in self.models], "peer_id": self.peer_id, "public_key": self.public_key,
                "seq": self.seq, "type": "catalogue_entry"}

    def signed(self, identity: Identity) -> CatalogueEntry:
        return replace(self, sig=identity.sign(CATALOGUE_KIND, canonical(self.body())))

    def verifies(self) -> bool:
        try:
            return (peer_id_from_public_key(self.public_key) == self.peer_id
                    and verify(self.public_key, CATALOGUE_KIND, canonical(self.body()), self.sig))
        except SwarmError:
            return False

    def encode(self) -> bytes:
        return canonical({**self.body(), "sig": self.sig})

    @classmethod
    def decode(cls, data: bytes) -> CatalogueEntry:
        """``ProtocolError`` for anything that is not a well-formed entry (the signature is not checked)."""
        if len(data) > MAX_RECORD_BYTES:
            bad(f"record of {len(data)} bytes exceeds {MAX_RECORD_BYTES}", code=ErrorCode.FRAME_TOO_LARGE)
        f = Fields(unpack(data), "catalogue_entry")
        if f.raw("type") != "catalogue_entry":
            bad("not a catalogue entry")
        peer = f.bin("peer_id")
        if not is_peer_id(peer):
            bad("catalogue_entry.peer_id is not an Ed25519 peer ID")
        models = []
        for i, item in enumerate(f.array("models", lo=1, hi=MAX_MODELS_PER_ENTRY)):
            g = Fields(item, f"models[{i}]")
            models.append(CatalogueModel(g.text("model_id", max_bytes=MAX_MODEL_ID_BYTES, pattern=MODEL_ID_RE),
                                         g.bin("config_digest", size=32),
                                         g.text("name", max_bytes=MAX_NAME_BYTES, pattern=_NAME)))
        if len({m.model_id for m in models}) != len(models):
            bad("catalogue_entry.models names a model twice")
        endpoints = tuple(check_text(e, "endpoints[]", max_bytes=MAX_ENDPOINT_BYTES, pattern=ENDPOINT_RE)
                          for e in f.array("endpoints", lo=1, hi=MAX_ENDPOINTS))
        return cls(peer, f.bin("public_key", size=PUBLIC_KEY_SIZE), tuple(models), endpoints, f.uint("seq"),
                   f.uint("expires_at_ms"), f.bin("sig", size=SIGNATURE_SIZE))


def catalogue_model(model_id: str, config: bytes, name: str | None) -> CatalogueModel:
    """The catalogue's line for a model served as ``model_id`` whose id hashes ``config`` (see
    ``moeswarm.model.model_id.config_bytes``): its digest, and the human name cut to
    ``MAX_NAME_BYTES``, control characters dropped."""
    name = "".join(c for c in (name or "") if _NAME.fullmatch(c))
    while len(name.encode()) > MAX_NAME_BYTES:
        name = name[:-1]
    return CatalogueModel(model_id, hashlib.sha256(config).digest(), name)


_DERIVED_ID = re.compile(r"[a-z0-9_]+-([0-9a-f]{12})(?:-[a-z0-9_]+)?")


def id_digest_prefix(model_id: str) -> str | None:
    """The 12 hex digits of config hash a derived model id carries (``mixtral-76b2c92d8168``,
    ``mixtral-76b2c92d8168-q8_0``; ``moeswarm.model.model_id`` derives them), or ``None`` for an id
    chosen with --model-id."""
    m = _DERIVED_ID.fullmatch(model_id)
    return None if m is None else m.group(1)


def sign_catalogue_entry(identity: Identity, models: Sequence[CatalogueModel], endpoints: Sequence[str], *,
                         seq: int, expires_at_ms: int) -> CatalogueEntry:
    return CatalogueEntry(identity.peer_id, identity.public_key, tuple(models), tuple(endpoints), seq,
                          expires_at_ms).signed(identity)


def catalogue_key(peer_id: bytes) -> str:
    return f"{CATALOGUE_PROVIDER_KEY}/{peer_id_to_str(peer_id)}"


def is_catalogue_key(key: str) -> bool:
    return _KEY.fullmatch(key) is not None


def _now_ms(now_ms: int | None) -> int:
    return int(time.time() * 1000) if now_ms is None else now_ms


def validate_catalogue(key: str, value: bytes, stored: bytes | None = None, *,
                       now_ms: int | None = None) -> CatalogueEntry:
    """Accept a catalogue entry for ``key`` or raise ``ProtocolError``: size (3), decoding (4), the
    key names the signer (9), key and signature (9), expiry (15), too-distant expiry (4), and a
    ``seq`` above a still-valid ``stored`` entry's (14): the announcement's rule."""
    return validate_peer_record("catalogue entry", _KEY, CatalogueEntry.decode, key, value, stored, now_ms=now_ms)


def select_catalogue(key: str, values: Sequence[bytes]) -> int:
    """Index of the valid catalogue entry with the highest seq (the first on a tie)."""
    return select_newest("catalogue entry", validate_catalogue, key, values)


# ------------------------------------------------------------------ reading


@dataclass
class Offer:
    """One model as the catalogue's entries name it: its digest, a name, and who serves it."""

    model_id: str
    config_digest: bytes
    name: str
    holders: list[CatalogueEntry] = field(default_factory=list)


@dataclass
class Catalogue:
    """One pass over the catalogue: offers by model id (each with the digest most holders publish)
    and what was dropped, by reason."""

    offers: dict[str, Offer] = field(default_factory=dict)
    rejected: dict[str, int] = field(default_factory=dict)

    def reject(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1


async def read_catalogue(dht: Any, *, max_peers: int = MAX_CATALOGUE_PEERS,
                         max_models: int = MAX_CATALOGUE_MODELS, now_ms: int | None = None) -> Catalogue:
    """Every valid entry among at most ``max_peers`` providers of the catalogue key, grouped by model
    id (at most ``max_models``). An entry whose derived model id disagrees with its digest is
    dropped (``digest_not_id``); where holders publish different digests for one id, the digest
    most of them publish wins (ties: the smallest) and the others are counted (``digest_minority``)."""
    out = Catalogue()
    try:
        providers = await dht.find_providers(CATALOGUE_PROVIDER_KEY, max_peers)
    except SwarmError as e:
        log.info("find_providers for the catalogue failed: %s", e)
        return out
    by_digest: dict[str, dict[bytes, Offer]] = {}
    peers = list(dict.fromkeys(providers))[:max_peers]  # a provider may be listed twice
    gate = asyncio.Semaphore(PARALLEL_GETS)

    async def get(peer: str) -> tuple[str, bytes | None] | SwarmError:
        try:
            key = catalogue_key(peer_id_from_str(peer))
            async with gate:
                return key, await dht.get(key)
        except SwarmError as e:
            return e

    for peer, got in zip(peers, await asyncio.gather(*(get(p) for p in peers))):  # in provider order
        try:
            if isinstance(got, SwarmError):
                raise got
            key, value = got
            if value is None:
                out.reject("no_entry")
                continue
            entry = validate_catalogue(key, value, now_ms=now_ms)
        except SwarmError as e:  # ProtocolError is one
            log.info("catalogue entry of %s rejected: %s", peer, e)
            out.reject("invalid_entry")
            continue
        for model in entry.models:
            prefix = id_digest_prefix(model.model_id)
            if prefix is not None and prefix != model.config_digest.hex()[:12]:
                out.reject("digest_not_id")
                continue
            offers = by_digest.get(model.model_id)
            if offers is None:
                if len(by_digest) >= max_models:
                    out.reject("too_many_models")
                    continue
                offers = by_digest[model.model_id] = {}
            offer = offers.setdefault(model.config_digest, Offer(model.model_id, model.config_digest, model.name))
            offer.holders.append(entry)
    for model_id, offers in by_digest.items():
        ranked = sorted(offers.values(), key=lambda o: (-len(o.holders), o.config_digest))
        out.offers[model_id] = ranked[0]
        for _ in ranked[1:]:
            out.reject("digest_minority")
    return out


@dataclass(frozen=True)
class ServedModel:
    """A model of the catalogue whose config a holder handed out and the digest confirmed."""

    model_id: str
    name: str
    config_digest: bytes
    config: bytes  # the bytes whose SHA-256 is ``config_digest``
    holders: tuple[str, ...]  # peer IDs (text) whose entries list it


Fetch = Callable[[CatalogueEntry, str], Any]  # (holder's entry, model id) -> awaitable of config bytes


async def resolve_models(catalogue: Catalogue, fetch: Fetch, *,
                         wanted: Sequence[str] | None = None) -> list[ServedModel]:
    """Each offer (of ``wanted`` ids, if given) whose config one of up to ``CONFIG_TRIES`` holders
    hands out (``fetch``: ``moeswarm.net.client.fetch_config``) with the published digest; a holder
    whose config does not hash to it is counted (``config_mismatch``), one that cannot be reached
    too (``config_unreachable``)."""
    get = fetch

    async def one(offer: Offer) -> ServedModel | None:
        for entry in offer.holders[:CONFIG_TRIES]:
            try:
                config = await get(entry, offer.model_id)
            except (SwarmError, OSError, TimeoutError) as e:
                log.info("config of %s from %s: %s", offer.model_id, peer_id_to_str(entry.peer_id), e)
                catalogue.reject("config_unreachable")
                continue
            if hashlib.sha256(config).digest() != offer.config_digest:
                log.warning("%s handed out a config of %s that does not match its digest",
                            peer_id_to_str(entry.peer_id), offer.model_id)
                catalogue.reject("config_mismatch")
                continue
            return ServedModel(offer.model_id, offer.name, offer.config_digest, config,
                               tuple(peer_id_to_str(h.peer_id) for h in offer.holders))
        return None

    offers = [o for o in catalogue.offers.values() if wanted is None or o.model_id in wanted]
    found = await asyncio.gather(*(one(o) for o in offers))
    return [m for m in found if m is not None]


__all__ = [
    "CATALOGUE_PROVIDER_KEY",
    "Catalogue",
    "CatalogueEntry",
    "CatalogueModel",
    "Offer",
    "ServedModel",
    "catalogue_key",
    "catalogue_model",
    "is_catalogue_key",
    "read_catalogue",
    "resolve_models",
    "select_catalogue",
    "sign_catalogue_entry",
    "validate_catalogue",
]
