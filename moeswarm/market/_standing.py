"""Reporters' standing from the ledger, which ``merge_reports`` weighs demand reports by
(``POST {ledger}/v1/standing``): the credit each paid for calls and did not get back
(``standing``: paid - earned, bounded by its lifetime figure; see ``moeswarm.ledger.Standing``).
A ledger from before that rule answers only ``paid``, which is used then."""

from __future__ import annotations

from collections.abc import Iterable

import aiohttp

from moeswarm.errors import BadResponse, Unreachable
from moeswarm.protocol import peer_id_from_str, peer_id_to_str

MAX_PEERS_PER_QUERY = 1024  # the ledger service's limit per POST


def _weight(s: dict[str, object]) -> float:
    return float(s["standing"] if "standing" in s else s["paid"])  # type: ignore[arg-type]


async def fetch_standing(ledger_url: str, peers: Iterable[bytes], since_ms: int,
                         timeout_s: float = 10.0) -> dict[bytes, float]:
    """Standing of each of ``peers``: credit paid for calls appended since ``since_ms`` and not got back."""
    wanted = list(dict.fromkeys(peers))
    out: dict[bytes, float] = {}
    url = ledger_url.rstrip("/") + "/v1/standing"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
            for i in range(0, len(wanted), MAX_PEERS_PER_QUERY):
                body = {"peers": [peer_id_to_str(p) for p in wanted[i : i + MAX_PEERS_PER_QUERY]],
                        "since_ms": since_ms}
                async with http.post(url, json=body) as resp:
                    if resp.status != 200:
                        raise BadResponse(f"the ledger at {ledger_url} answered {resp.status}: {await resp.text()}")
                    answer = await resp.json()
                for s in answer["standing"]:
                    out[peer_id_from_str(s["peer"])] = _weight(s)
    except (aiohttp.ClientError, TimeoutError) as e:
        raise Unreachable(f"ledger at {ledger_url}: {e}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise BadResponse(f"the ledger's standing does not parse: {e}") from None
    return out


async def fetch_top_standing(ledger_url: str, since_ms: int, limit: int,
                             timeout_s: float = 10.0) -> dict[bytes, float]:
    """The ``limit`` peers with the most standing since ``since_ms``, with their standing."""
    url = f"{ledger_url.rstrip('/')}/v1/standing"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http, http.get(
                url, params={"since_ms": str(since_ms), "limit": str(min(limit, MAX_PEERS_PER_QUERY))}) as resp:
            if resp.status != 200:
                raise BadResponse(f"the ledger at {ledger_url} answered {resp.status}: {await resp.text()}")
            answer = await resp.json()
        return {peer_id_from_str(s["peer"]): _weight(s) for s in answer["standing"]}
    except (aiohttp.ClientError, TimeoutError) as e:
        raise Unreachable(f"ledger at {ledger_url}: {e}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise BadResponse(f"the ledger's standing does not parse: {e}") from None
