"""Broken model folders: one clear line naming the file (and tensor), exit code 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moeswarm.errors import CheckpointError
from moeswarm.model import load_model


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "moeswarm.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture
def folder(oracle_checkpoints, tmp_path: Path) -> Path:
    src, _ = oracle_checkpoints.get("mixtral", "per_expert")
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def assert_one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_missing_folder() -> None:
    r = cli("generate", "--model", "/nonexistent/model", "--prompt-ids", "[1]")
    assert_one_line_error(r, "/nonexistent/model")


def test_missing_config(folder: Path) -> None:
    (folder / "config.json").unlink()
    assert_one_line_error(cli("generate", "--model", str(folder), "--prompt-ids", "[1]"), "config.json")


def test_unsupported_architecture(folder: Path) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "llama"
    (folder / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(cli("generate", "--model", str(folder), "--prompt-ids", "[1]"), "'llama'", "config.json")


def test_truncated_safetensors(folder: Path) -> None:
    shard = next(folder.glob("*.safetensors"))
    size = shard.stat().st_size
    with open(shard, "r+b") as fh:
        fh.truncate(size - 1000)
    r = cli("generate", "--model", str(folder), "--prompt-ids", "[1]")
    assert_one_line_error(r, str(shard), "truncated", "tensor ")


def test_shape_mismatch_names_file_and_tensor(folder: Path) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] += 1  # every expert tensor now disagrees with config.json
    (folder / "config.json").write_text(json.dumps(cfg))
    r = cli("generate", "--model", str(folder), "--prompt-ids", "[1]")
    assert_one_line_error(r, "model.layers.0.block_sparse_moe.experts.0.w1.weight", ".safetensors", "does not match")


def test_missing_tensor(folder: Path, tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    shard = next(folder.glob("*.safetensors"))
    tensors = load_file(shard)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, shard)
    with pytest.raises(CheckpointError, match=r"missing tensor '1\.attn\.k'"):
        load_model(folder)


def test_missing_shard_named_in_index(oracle_checkpoints, tmp_path: Path) -> None:
    src, _ = oracle_checkpoints.get("deepseek_v3", "per_expert")
    dst = tmp_path / "ds"
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[-1]
    (dst / victim).unlink()
    r = cli("generate", "--model", str(dst), "--prompt-ids", "[1]")
    assert_one_line_error(r, victim, "not found")


def test_bad_prompt_ids(folder: Path) -> None:
    assert_one_line_error(cli("generate", "--model", str(folder), "--prompt-ids", "[1, 99999]"), "prompt token ids")
    assert_one_line_error(cli("generate", "--model", str(folder), "--prompt-ids", "not json"), "--prompt-ids")
