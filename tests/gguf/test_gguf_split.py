"""A GGUF split as llama.cpp's gguf-split splits it (``name-00001-of-00003.gguf``...) loads as one
memory-mapped model and gives the tokens of the single file; ``convert-gguf --split-max-size`` writes it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from moeswarm.errors import CheckpointError
from moeswarm.model import SamplingParams, generate, load_model
from moeswarm.model.gguf import convert_to_gguf
from moeswarm.model.memory import expert_ranges
from moeswarm.model.model_id import model_id_for

ARCH = "qwen2_moe"  # dense and MoE layers, shared experts: many tensors of several sizes


def _shards_for(sizes: list[int], limit: int) -> int:
    """gguf-py's rule (the writer llama.cpp's converter uses): a new shard when the current one
    has a tensor and this one would take it past ``limit`` bytes."""
    shards, current = 1, 0
    for n in sizes:
        if current and current + n > limit:
            shards, current = shards + 1, 0
        current += n
    return shards


def _fields(path: Path) -> dict[str, object]:
    r = GGUFReader(path)
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}


def test_a_gguf_split_in_three_files_gives_the_tokens_of_the_single_file(oracle_checkpoints, tmp_path: Path) -> None:
    folder, ref = oracle_checkpoints.get(ARCH, "per_expert")
    single = convert_to_gguf(folder, tmp_path / "single" / "m.gguf", weight_type="F16", experts_type="Q8_0",
                             sidecar=False)
    sizes = [p.nbytes for p in single.tensors]
    limit = next(n for n in range(sum(sizes) // 3, sum(sizes)) if _shards_for(sizes, n) == 3)
    done = subprocess.run([sys.executable, "-m", "moeswarm.cli", "convert-gguf", "--model", str(folder), "--out",
                           str(tmp_path / "split" / "m.gguf"), "--type", "F16", "--experts-type", "Q8_0",
                           "--split-max-size", str(limit), "--no-sidecar", "-q"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    shards = sorted((tmp_path / "split").iterdir())
    assert [s.name for s in shards] == [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)], shards
    assert "in 3 files" in done.stdout
    # the split.* keys, read with llama.cpp's own gguf reader; the metadata lives in the first shard
    fields = [_fields(s) for s in shards]
    for i, f in enumerate(fields):
        assert (f["split.no"], f["split.count"], f["split.tensors.count"]) == (i, 3, len(single.tensors))
    assert "general.architecture" in fields[0] and set(fields[1]) == set(fields[2]) == {
        "split.no", "split.count", "split.tensors.count"}
    assert sum(len(GGUFReader(s).tensors) for s in shards) == len(single.tensors)

    one = load_model(single.path)
    expected = list(generate(one, ref.prompt_ids, SamplingParams(max_new_tokens=8)))
    for name in (shards[0], shards[2], tmp_path / "split"):  # any shard, or the folder, names the model
        model = load_model(name)
        cache = model.new_cache()
        assert np.array_equal(model.forward(np.asarray([ref.prompt_ids]), cache),
                              one.forward(np.asarray([ref.prompt_ids]), one.new_cache()))
        assert list(generate(model, ref.prompt_ids, SamplingParams(max_new_tokens=8))) == expected
    assert model_id_for(str(shards[0]), model.config) == model_id_for(str(single.path), one.config)
    # memory-mapped from every shard: the experts are views of the shards' maps
    files = {path for layer in model.weights.experts.values() for w in layer.values() for path, _, _ in
             expert_ranges(w)}
    assert len(files) >= 2 and files <= {str(s) for s in shards}


def test_a_missing_or_misnumbered_shard_is_named(oracle_checkpoints, tmp_path: Path) -> None:
    folder, _ = oracle_checkpoints.get(ARCH, "per_expert")
    report = convert_to_gguf(folder, tmp_path / "m.gguf", weight_type="F16", sidecar=False, split_max_size=200_000)
    shards = report.shards
    assert len(shards) >= 3 and report.path == shards[0]
    last = shards[-1]
    last.rename(tmp_path / "elsewhere.bin")
    with pytest.raises(CheckpointError, match=f"shard {last.name} .* is missing"):
        load_model(shards[0])
    # a shard renamed into another place of the set: its split.no says otherwise
    shards[1].rename(tmp_path / "tmp.gguf")
    (tmp_path / "elsewhere.bin").rename(shards[1])
    (tmp_path / "tmp.gguf").rename(last)
    with pytest.raises(CheckpointError, match=r"shard 2 of \d+ says it is split.no"):
        load_model(shards[0])
