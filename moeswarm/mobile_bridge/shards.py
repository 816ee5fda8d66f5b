"""Exported ONNX layer shards opened with onnxruntime, one session per layer.

Session options follow the onnxruntime spike (``spikes/moe/FINDINGS.md`` section 3): one
intra-op thread by default, spinning off (spinning threads steal the cores from everything
else on the device), and, when ``mmap`` is asked for, prepacking disabled so that onnxruntime
memory-maps the external weights file instead of copying it into anonymous memory (creating a
session then costs milliseconds and the kernel can page cold experts out; batches of 8 or more
rows get slower).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from ..errors import ConfigError
from ..model import load_config
from ._graph import DTYPES, input_name, output_name
from ._manifest import Manifest


@dataclass(frozen=True)
class RuntimeConfig:
    threads: int = 1  # onnxruntime intra-op threads per session
    mmap: bool = False  # memory-map weights (prepacking off) instead of copying them
    verify_hashes: bool = True  # check every file against manifest.json before loading


def session_options(config: RuntimeConfig) -> ort.SessionOptions:
    from ..model._qkernels import global_pool_active

    so = ort.SessionOptions()
    if global_pool_active():  # the quantized kernels made onnxruntime's global pool: every session shares it
        so.use_per_session_threads = False
    else:
        so.intra_op_num_threads = config.threads
        so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.add_session_config_entry("session.inter_op.allow_spinning", "0")
    if config.mmap:
        so.add_session_config_entry("session.disable_prepacking", "1")
    so.log_severity_level = 3  # warnings about buffer reuse across empty branches are noise
    return so


class OnnxShards:
    """The experts of a shard folder: ``run(layer, {expert: x (n, H)}) -> {expert: y (n, H)}``."""

    def __init__(self, folder: str | Path, config: RuntimeConfig = RuntimeConfig(),
                 *, layers: tuple[int, int] | None = None, experts: tuple[int, int] | None = None) -> None:
        self.folder = Path(folder)
        self.manifest = Manifest.read(self.folder)
        if config.verify_hashes:
            self.manifest.verify(self.folder)
        self.model_config = load_config(self.folder)
        m = self.manifest
        if m.dtype not in DTYPES:
            raise ConfigError(f"shards have unsupported dtype {m.dtype!r}")
        self.dtype = DTYPES[m.dtype][0]
        self.layers = _within(layers, m.layers, "layers")
        self.experts = _within(experts, m.experts, "experts")
        options = session_options(config)
        self._sessions: dict[int, ort.InferenceSession] = {}
        self._held: dict[int, tuple[int, ...]] = {}
        for shard in m.shards:
            if not self.layers[0] <= shard.layer <= self.layers[1]:
                continue
            path = str(self.folder / shard.file)
            try:
                session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
            except Exception as e:  # onnxruntime raises its own zoo; the file is at fault
                raise ConfigError(f"onnxruntime cannot open {path}: {e}") from None
            self._sessions[shard.layer] = session
            self._held[shard.layer] = tuple(range(shard.experts[0], shard.experts[1] + 1))
        if not self._sessions:
            raise ConfigError(f"no shard of {self.folder} lies in layers {self.layers[0]}-{self.layers[1]}")

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(sorted(self._sessions))

    def holds(self, layer: int, expert: int) -> bool:
        return layer in self._sessions and self.experts[0] <= expert <= self.experts[1]

    def held(self, layer: int) -> tuple[int, ...]:
        """Expert ids served in ``layer`` (empty if the layer is not held)."""
        return tuple(e for e in self._held.get(layer, ()) if self.experts[0] <= e <= self.experts[1])

    @property
    def file_bytes(self) -> int:
        """Bytes of weights on disk for the held layers (the capacity announced)."""
        total = 0
        for layer in self._sessions:
            total += (self.folder / self.manifest.shard(layer).data).stat().st_size
        return total

    def run(self, layer: int, inputs: Mapping[int, np.ndarray]) -> dict[int, np.ndarray]:
        """Compute the given experts of ``layer``; every other branch gets an empty input.

        ``inputs[e]`` is ``(n_e, H)`` (any float dtype); outputs are ``(n_e, H)`` float32.
        """
        session = self._sessions[layer]
        hidden = self.manifest.hidden_size
        empty = np.empty((0, hidden), self.dtype)
        feed = {input_name(e): empty for e in self._held[layer]}
        for e, x in inputs.items():
            feed[input_name(e)] = np.ascontiguousarray(x, dtype=self.dtype)
        wanted = sorted(inputs)
        outs = session.run([output_name(e) for e in wanted], feed)
        return {e: y.astype(np.float32, copy=False) for e, y in zip(wanted, outs)}


def _within(asked: tuple[int, int] | None, available: tuple[int, int], what: str) -> tuple[int, int]:
    if asked is None:
        return available
    if not available[0] <= asked[0] <= asked[1] <= available[1]:
        raise ConfigError(f"--{what} {asked[0]}-{asked[1]} is not within the exported {available[0]}-{available[1]}")
    return asked
