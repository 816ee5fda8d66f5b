"""Use the swarm without running a backbone: find gateways, pick one, stream, fail over.

``find_gateways(bootstrap, model_id)`` joins the DHT as a client and reads the gateways' signed
records (``moeswarm.net.gateways``). ``GatewayClient`` measures its own round trip to each
(``GET /healthz``, best of three), ranks them (``rank``: gateways with a free place in their batch
first, then by the client's round trip plus the gateway's announced round trip to its holders,
then by more free places), and streams a completion from the best. When the gateway dies mid
generation it resumes the same generation on the next one: the prompt plus the tokens received
so far are the new prompt, the tokens still owed the new budget, so greedy output is unchanged.
``on_choice(record)`` is called for every choice and switch (the CLI prints ``gateway PEER_ID URL``).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from ..errors import BadResponse, ConfigError, Timeout, Unreachable
from ..net.gateways import GatewayRecord, read_gateways

PING_TRIES = 3


class PaymentRequired(ConfigError):
    """A gateway answered 402: it charges, and this client sent no authorization it accepts; the
    client goes on to the next gateway."""


async def find_gateways_async(bootstrap: Sequence[str], model_id: str | None, *, wait_s: float = 10.0,
                              interval_s: float = 0.5) -> list[GatewayRecord]:
    """Gateways serving ``model_id`` (any model: None), read through a DHT client joined via ``bootstrap``;
    retried every ``interval_s`` until one is found or ``wait_s`` passes."""
    from ..daemon import SwarmConfig, p2p_node
    from ..protocol import Identity

    async with p2p_node(Identity.generate(), SwarmConfig("", bootstrap=tuple(bootstrap), client_mode=True)) as p2p:
        deadline = time.monotonic() + wait_s
        while True:
            found = await read_gateways(p2p, model_id)
            if found or time.monotonic() >= deadline:
                return found
            await asyncio.sleep(interval_s)


def find_gateways(bootstrap: Sequence[str], model_id: str | None, *, wait_s: float = 10.0) -> list[GatewayRecord]:
    return asyncio.run(find_gateways_async(bootstrap, model_id, wait_s=wait_s))


def _connect(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urlsplit(url)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    return kind(parts.hostname or "", parts.port, timeout=timeout), parts.path.rstrip("/")


def measure_rtt(url: str, timeout: float = 5.0, tries: int = PING_TRIES) -> float | None:
    """Best of ``tries`` round trips of ``GET /healthz`` on one connection, seconds (None: unreachable)."""
    try:
        conn, base = _connect(url, timeout)
        try:
            best = float("inf")
            for _ in range(tries):
                t0 = time.perf_counter()
                conn.request("GET", base + "/healthz")
                conn.getresponse().read()
                best = min(best, time.perf_counter() - t0)
            return best
        finally:
            conn.close()
    except (OSError, http.client.HTTPException):
        return None


@dataclass(frozen=True)
class Candidate:
    record: GatewayRecord
    rtt_s: float  # the client's measured round trip to the gateway's API

    @property
    def expected_s(self) -> float:
        """What one round trip from here through the gateway to its holders costs, seconds."""
        return self.rtt_s + self.record.rtt_us / 1e6


def rank(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Free places first, then least expected latency, then most free places (then peer id)."""
    return sorted(candidates, key=lambda c: (c.record.free_slots == 0, c.expected_s, -c.record.free_slots,
                                             c.record.peer_id))


@dataclass
class Generation:
    """What a finished generation produced, and through whom."""

    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    gateways: list[str]  # peer ids used, in order
    finish_reason: str | None


class GatewayClient:
    """Streams completions from the swarm's gateways (see the module docstring).

    ``authorize(record, owed_tokens)`` returns the headers a request to ``record`` carries (a
    spending authorization, ``moeswarm.sdk.spending``), or {} for a free gateway."""

    def __init__(self, gateways: Sequence[GatewayRecord], *, model: str | None = None, timeout: float = 60.0,
                 on_choice: Callable[[GatewayRecord], None] = lambda r: None,
                 authorize: Callable[[GatewayRecord], dict[str, str]] = lambda r: {}) -> None:
        if not gateways:
            raise Unreachable("no gateway serves this model in the swarm")
        self.model, self.timeout, self.on_choice, self.authorize = model, timeout, on_choice, authorize
        measured = [(r, measure_rtt(r.url, min(timeout, 5.0))) for r in gateways]
        self.candidates = rank([Candidate(r, t) for r, t in measured if t is not None])
        if not self.candidates:
            raise Unreachable(f"none of the {len(gateways)} gateways found answers")

    def stream(self, prompt: str | Sequence[int] | None = None, *, messages: Sequence[dict[str, str]] | None = None,
               max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
               seed: int | None = None, result: Generation | None = None) -> Iterator[tuple[str, list[int]]]:
        """(text piece, token ids) as they arrive, resumed across gateways; ``result`` is filled in."""
        out = result if result is not None else Generation([], [], "", [], None)
        prompt_ids: list[int] | None = None if isinstance(prompt, str) or messages is not None else list(prompt or [])
        dead: set[bytes] = set()
        for candidate in self.candidates:
            if candidate.record.peer_id in dead:
                continue
            record = candidate.record
            out.gateways.append(record.peer)
            self.on_choice(record)
            owed = max_new_tokens - len(out.token_ids)
            body: dict[str, Any] = {"max_tokens": owed, "temperature": temperature, "top_p": top_p, "top_k": top_k,
                                    "stream": True, "return_token_ids": True}
            if self.model is not None:
                body["model"] = self.model
            if seed is not None:
                body["seed"] = seed
            if prompt_ids is not None:  # resuming, or ids given: the same generation continues
                path, body["prompt"] = "/v1/completions", prompt_ids + out.token_ids
            elif messages is not None:
                path, body["messages"] = "/v1/chat/completions", list(messages)
            else:
                path, body["prompt"] = "/v1/completions", prompt
            try:
                for event in self._events(record, path, body):
                    choice = event["choices"][0] if event.get("choices") else None
                    if choice is None:
                        continue
                    if prompt_ids is None and isinstance(choice.get("prompt_token_ids"), list):
                        prompt_ids = [int(t) for t in choice["prompt_token_ids"]]
                    ids = [int(t) for t in choice.get("token_ids") or []]
                    piece = (choice.get("delta") or {}).get("content") if messages is not None and "delta" in choice \
                        else choice.get("text")
                    piece = piece if isinstance(piece, str) else ""
                    out.token_ids += ids
                    out.text += piece
                    if choice.get("finish_reason") is not None:
                        out.finish_reason = choice["finish_reason"]
                    if piece or ids:
                        yield piece, ids
                out.prompt_ids = prompt_ids or []
                return
            except (Unreachable, Timeout, BadResponse, PaymentRequired):
                dead.add(record.peer_id)
                if out.token_ids and prompt_ids is None:
                    raise  # tokens came but not the prompt's: cannot resume exactly
                if len(out.token_ids) >= max_new_tokens:
                    out.prompt_ids = prompt_ids or []
                    return
        raise Unreachable(f"every gateway failed or wants payment ({len(dead)} tried)")

    def _events(self, record: GatewayRecord, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        headers = {"Content-Type": "application/json", **self.authorize(record)}
        conn, base = _connect(record.url, self.timeout)
        try:
            conn.request("POST", base + path, body=json.dumps(body).encode(), headers=headers)
            response = conn.getresponse()
            if response.status >= 400:
                data = response.read()
                if response.status == 402:  # priced, and this client does not pay it (or no longer)
                    raise PaymentRequired(f"the gateway {record.url} wants payment: {data[:300].decode(errors='replace')}")
                if 400 <= response.status < 500:
                    raise ConfigError(f"the gateway {record.url} refused the request (HTTP {response.status}): "
                                      f"{data[:300].decode(errors='replace')}")
                raise BadResponse(f"the gateway {record.url} failed (HTTP {response.status})")
            for line in response:
                text = line.decode("utf-8", errors="replace").strip()
                if not text.startswith("data:"):
                    continue
                data = text[5:].strip()
                if data == "[DONE]":
                    return
                try:
                    event = json.loads(data)
                except ValueError:
                    raise BadResponse(f"the gateway {record.url} sent something that is not JSON") from None
                if not isinstance(event, dict):
                    raise BadResponse(f"the gateway {record.url} sent JSON that is not an object")
                if "error" in event:
                    raise BadResponse(f"the gateway {record.url} failed while streaming: {event['error']}")
                yield event
            raise BadResponse(f"the stream from {record.url} ended without [DONE]")
        except TimeoutError as e:
            raise Timeout(f"{record.url} did not answer in time") from e
        except (OSError, http.client.HTTPException) as e:
            raise Unreachable(f"lost the gateway {record.url}: {e}") from e
        finally:
            conn.close()


def model_id_of(model: str) -> str:
    """``--model`` as a model id: a checkpoint folder or its config.json gives the id derived from
    it (``moeswarm.model.model_id``); anything else is taken as an id from the swarm's catalogue."""
    import os

    from ..protocol._codec import MODEL_ID_RE

    path = model
    if os.path.isfile(path) and os.path.basename(path).endswith(".json"):
        path = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or path.endswith(".gguf"):
        from ..model import load_config
        from ..model.model_id import model_id_for

        return model_id_for(path, load_config(path))
    if not MODEL_ID_RE.fullmatch(model):
        raise ConfigError(f"--model {model!r} is neither a checkpoint folder, its config.json, nor a model id")
    return model


__all__ = ["Candidate", "GatewayClient", "Generation", "PaymentRequired", "find_gateways", "find_gateways_async",
           "measure_rtt", "model_id_of", "rank"]
