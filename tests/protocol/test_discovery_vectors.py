"""``protocol_spec/vectors/discovery.json`` (``protocol_spec/discovery.md``): the announcement
topic's name, a first-view request and answer byte for byte, and records in it that a topic's
gate accepts as of the vector's clock (and no longer once they have expired)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moeswarm.net.gossip_view import (
    GossipLimits,
    TopicGate,
    announce_topic,
    sync_answer,
    sync_request,
)

GENERATOR = Path(__file__).resolve().parents[2] / "protocol_spec" / "vectors" / "generate_discovery.py"


def test_discovery_vectors(load_vector: Callable[[str], Any]) -> None:
    v = load_vector("discovery.json")
    records = [bytes.fromhex(r) for r in v["records_hex"]]
    assert announce_topic(v["model_id"]) == v["topic"]
    assert sync_request(v["model_id"]).hex() == v["request_hex"]
    assert sync_answer(records).hex() == v["answer_hex"]
    assert sync_answer([]).hex() == v["empty_answer_hex"] == "00000000"
    frames, data = [], bytes.fromhex(v["answer_hex"])  # an independent reading of the framing
    while (length := int.from_bytes(data[:4], "big")) > 0:
        frames.append(data[4:4 + length])
        data = data[4 + length:]
    assert frames == records and data == bytes(4)

    at_vector_time = TopicGate(v["model_id"], GossipLimits(), num_layers=4, num_experts=16,
                               wall_ms=lambda: v["now_ms"])
    assert all(at_vector_time.check("p", None, r) is not None for r in records)
    assert all(TopicGate(v["model_id"], GossipLimits()).check("p", None, r) is None for r in records)  # expired


def test_the_vectors_are_up_to_date() -> None:
    done = subprocess.run([sys.executable, str(GENERATOR), "--check"], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, "protocol_spec/vectors/discovery.json is out of date: run generate_discovery.py"
