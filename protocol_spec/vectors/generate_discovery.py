#!/usr/bin/env python3
"""Regenerate ``discovery.json`` (``protocol_spec/discovery.md``): a model's announcement topic and
a first-view request and answer, byte for byte, from the fixed keys of ``generate.py``.

    python protocol_spec/vectors/generate_discovery.py           # rewrite discovery.json
    python protocol_spec/vectors/generate_discovery.py --check   # exit 1 if it is out of date
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

from generate import CLIENT, MODEL_ID, NOW_MS, SERVER  # noqa: E402

from moeswarm import protocol as p  # noqa: E402
from moeswarm.net.gossip_view import announce_topic, sync_answer, sync_request  # noqa: E402


def vectors() -> dict[str, object]:
    records = [p.encode(p.sign_announcement(
        who, model_id=MODEL_ID, layers=layers, experts=experts, endpoints=(f"tcp+tls://192.0.2.{i + 1}:7000",),
        capacity_bytes=1 << 30, throughput=100, load_permille=0, software="moeswarm/0.1.0", seq=NOW_MS + i,
        expires_at_ms=NOW_MS + 600_000)) for i, (who, layers, experts) in enumerate(
        ((SERVER, (0, 3), (0, 7)), (CLIENT, (1, 1), (8, 15))))]
    return {
        "model_id": MODEL_ID, "now_ms": NOW_MS, "topic": announce_topic(MODEL_ID),
        "request_hex": sync_request(MODEL_ID).hex(), "records_hex": [r.hex() for r in records],
        "answer_hex": sync_answer(records).hex(), "empty_answer_hex": sync_answer([]).hex(),
    }


if __name__ == "__main__":
    text = json.dumps(vectors(), indent=1) + "\n"
    target = HERE / "discovery.json"
    if "--check" in sys.argv:
        sys.exit(0 if target.read_text() == text else 1)
    target.write_text(text)
