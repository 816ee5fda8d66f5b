"""Vision-language checkpoints serve their language model without reading the vision tower, and
``moeswarm generate --model DIR`` runs each family's folder."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from moeswarm.model._config_minimax_kimi import (
    ARCHITECTURES as ARCHITECTURES_MINIMAX_KIMI,
)

VISION_BYTES = 256 << 20  # a 256 MiB vision tensor, left as a file hole (reads back as zeros)

_PROBE = r"""
import json, sys
import numpy as np
from pathlib import Path

def rss():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10

from moeswarm.model import load_model
from moeswarm.model._safetensors import SafetensorsFile
folder, prompt = sys.argv[1], json.loads(sys.argv[2])
before = rss()
model = load_model(folder)
cache = model.new_cache()
model.forward(np.asarray([prompt]), cache)  # touches every language-model tensor it needs
for a in model.weights.tensors.values():
    float(np.asarray(a, dtype=np.float32).sum())  # and every other one
served = rss()
big = SafetensorsFile(Path(folder) / "vision-extra.safetensors").tensor("vision_tower.extra.weight")
float(big.sum())  # control: reading the vision tensor does show in RSS
print(json.dumps({"served": served - before, "after_reading_vision": rss() - before}))
"""


def _add_vision_shard(folder: Path) -> None:
    """A second shard holding one big vision tensor, and an index naming both shards."""
    n = VISION_BYTES // 4
    header = json.dumps({"vision_tower.extra.weight": {"dtype": "F32", "shape": [n], "data_offsets": [0, VISION_BYTES]}})
    blob = header.encode() + b" " * (-len(header) % 8)
    with open(folder / "vision-extra.safetensors", "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)) + blob)
        fh.truncate(8 + len(blob) + VISION_BYTES)
    with open(folder / "model.safetensors", "rb") as fh:
        (size,) = struct.unpack("<Q", fh.read(8))
        keys = [k for k in json.loads(fh.read(size)) if k != "__metadata__"]
    weight_map = {k: "model.safetensors" for k in keys} | {"vision_tower.extra.weight": "vision-extra.safetensors"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("arch", ["minimax_m3_vl", "kimi_k25"])
def test_the_vision_tower_is_never_read(family_checkpoints, arch: str, tmp_path: Path) -> None:
    folder, ref = family_checkpoints.get(arch)
    copy = tmp_path / arch
    shutil.copytree(folder, copy)
    _add_vision_shard(copy)
    out = subprocess.run([sys.executable, "-c", _PROBE, str(copy), json.dumps(ref.prompt_ids)],
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    grew = json.loads(out.stdout.strip().splitlines()[-1])
    assert grew["served"] < VISION_BYTES // 8, grew  # opening and serving the language model
    assert grew["after_reading_vision"] - grew["served"] > VISION_BYTES // 2, grew  # the probe can see a read


@pytest.mark.parametrize("arch", ARCHITECTURES_MINIMAX_KIMI)
def test_moeswarm_generate_runs_each_family_folder(family_checkpoints, arch: str) -> None:
    folder, ref = family_checkpoints.get(arch)
    n = len(ref.greedy_tokens)
    out = subprocess.run(
        [sys.executable, "-m", "moeswarm.cli", "generate", "--model", str(folder), "--prompt-ids",
         json.dumps(ref.prompt_ids), "--max-new-tokens", str(n), "--print-token-ids"],
        capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ref.greedy_tokens


def test_generate_help_says_images_are_not_supported() -> None:
    out = subprocess.run([sys.executable, "-m", "moeswarm.cli", "generate", "--help"], capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    assert "images are not supported yet" in text
    assert "MiniMax M3" in text and "Kimi K2.5" in text


def test_the_openai_api_refuses_an_image_part_saying_why() -> None:
    from moeswarm.node.http_api import ApiError, _content

    image = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    with pytest.raises(ApiError, match="images are not supported yet") as e:
        _content(image, "messages[0].content")
    assert e.value.status == 400 and e.value.param == "messages[0].content"
    assert _content([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "p") == "ab"
