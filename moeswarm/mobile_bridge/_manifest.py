"""``manifest.json`` of an exported shard folder: what the folder holds and the hash of every file.

    {"format": "moeswarm-onnx-shards/1", "model_id": "mixtral-0123456789ab", "arch": "mixtral",
     "dtype": "fp32", "hidden_size": 4096, "intermediate_size": 14336, "activation": "swiglu",
     "layers": [0, 31], "experts": [4, 5], "opset": 17,
     "shards": [{"layer": 0, "experts": [4, 5], "file": "layer_0000.onnx",
                 "data": "layer_0000.onnx.data", "sha256": {"layer_0000.onnx": "...", ...}}, ...],
     "files": {"config.json": "<sha256>"}}

``layers`` and ``experts`` are the inclusive ranges exported; ``shards`` has one entry per MoE
layer in ``layers`` (dense layers have no experts and no file). ``config.json`` is the model's
own file, copied byte for byte, so ``model_id_for(folder, cfg)`` gives the id nodes announce.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError

FORMAT = "moeswarm-onnx-shards/1"
MANIFEST = "manifest.json"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class ShardEntry:
    layer: int  # MoE layer index
    experts: tuple[int, int]  # inclusive range held in this file
    file: str  # the .onnx graph, relative to the folder
    data: str  # its external weights file, relative to the folder
    sha256: dict[str, str]  # file name -> hex digest, for both files


@dataclass(frozen=True)
class Manifest:
    model_id: str  # as nodes announce it (moeswarm.model.model_id.model_id_for)
    arch: str
    dtype: str  # "fp32" or "fp16": weights and computation
    hidden_size: int
    intermediate_size: int  # per-expert FFN width
    activation: str  # "swiglu" or "clamped_swiglu"
    layers: tuple[int, int]  # inclusive range exported
    experts: tuple[int, int]  # inclusive range exported in every MoE layer
    shards: tuple[ShardEntry, ...]
    files: dict[str, str] = field(default_factory=dict)  # other files -> sha256 (config.json)
    opset: int = 17
    format: str = FORMAT

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(s.layer for s in self.shards)

    def shard(self, layer: int) -> ShardEntry:
        for s in self.shards:
            if s.layer == layer:
                return s
        raise ConfigError(f"no shard for layer {layer}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True) + "\n"

    def write(self, folder: Path) -> None:
        (folder / MANIFEST).write_text(self.to_json())

    @classmethod
    def read(cls, folder: str | Path) -> "Manifest":
        path = Path(folder) / MANIFEST
        try:
            raw: dict[str, Any] = json.loads(path.read_text())
            if raw.get("format") != FORMAT:
                raise ConfigError(f"{path}: format {raw.get('format')!r} is not {FORMAT}")
            shards = tuple(ShardEntry(int(s["layer"]), _pair(s["experts"]), str(s["file"]), str(s["data"]),
                                      {str(k): str(v) for k, v in s["sha256"].items()}) for s in raw["shards"])
            return cls(str(raw["model_id"]), str(raw["arch"]), str(raw["dtype"]), int(raw["hidden_size"]),
                       int(raw["intermediate_size"]), str(raw["activation"]), _pair(raw["layers"]),
                       _pair(raw["experts"]), shards, {str(k): str(v) for k, v in raw.get("files", {}).items()},
                       int(raw.get("opset", 17)))
        except FileNotFoundError:
            raise ConfigError(f"{path} not found: is this an export-onnx output folder?") from None
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{path} is malformed: {e!r}") from None

    def verify(self, folder: str | Path) -> None:
        """``ConfigError`` naming the first file whose SHA-256 differs from the manifest's."""
        expected = dict(self.files)
        for s in self.shards:
            expected.update(s.sha256)
        for name, digest in sorted(expected.items()):
            path = Path(folder) / name
            if not path.is_file():
                raise ConfigError(f"{path} is missing")
            if sha256_file(path) != digest:
                raise ConfigError(f"{path} does not match the SHA-256 in {MANIFEST}")


def _pair(value: Any) -> tuple[int, int]:
    first, last = (int(v) for v in value)
    if first > last:
        raise ValueError(f"empty range {value}")
    return first, last
