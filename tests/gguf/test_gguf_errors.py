"""Broken GGUF checkpoints: one clear CheckpointError naming the file (and the tensor)."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from click.testing import CliRunner

from moeswarm.errors import CheckpointError
from moeswarm.model import load_model
from moeswarm.model._gguf_write import TensorPlan, plan, write_gguf
from moeswarm.model.gguf import GGUFFile, load_gguf_weights
from moeswarm.model.gguf_cli import convert_gguf
from moeswarm.model import load_weights


@pytest.fixture
def good(gguf_checkpoints, tmp_path: Path) -> Path:
    dst = tmp_path / "model.gguf"
    shutil.copyfile(gguf_checkpoints.get("mixtral", "F16", "Q8_0"), dst)
    return dst


def test_truncated_file_names_file_and_tensor(good: Path) -> None:
    last = GGUFFile(good).reader.tensors[-1].name
    with open(good, "r+b") as fh:
        fh.truncate(good.stat().st_size - 1000)
    with pytest.raises(CheckpointError, match="truncated") as e:
        load_model(good)
    assert e.value.path == str(good) and e.value.tensor == last
    assert str(good) in str(e.value) and last in str(e.value) and "\n" not in str(e.value)


def test_cli_reports_a_truncated_gguf_in_one_line(good: Path) -> None:
    with open(good, "r+b") as fh:
        fh.truncate(good.stat().st_size // 2)
    r = subprocess.run([sys.executable, "-m", "moeswarm.cli", "generate", "--model", str(good), "--prompt-ids", "[1]"],
                       capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "truncated" in lines[0] and str(good) in lines[0] and "tensor blk." in lines[0]


def test_not_a_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGML" + b"\0" * 60)
    with pytest.raises(CheckpointError, match="not a GGUF file: it does not begin with the bytes 'GGUF'") as e:
        load_model(bad)
    assert e.value.path == str(bad)
    with pytest.raises(CheckpointError, match="file not found"):
        load_model(tmp_path / "missing.gguf")


def test_corrupted_headers_fail_cleanly(good: Path, tmp_path: Path) -> None:
    """Random byte flips in the metadata or the tensor table: the file loads, or raises CheckpointError naming
    it; no other exception escapes."""
    reader = GGUFFile(good).reader
    table, end = reader.tensors[0].field.offset, reader.data_offset  # tensor table; metadata lies before it
    clean = good.read_bytes()
    rng = np.random.default_rng(0)
    outcomes = {"loaded": 0, "CheckpointError": 0}
    for i in range(100):
        data = bytearray(clean)
        for pos in rng.integers(table if i % 2 else 0, end, int(rng.integers(1, 5))):
            data[pos] = int(rng.integers(0, 256))
        bad = tmp_path / f"c{i}.gguf"
        bad.write_bytes(bytes(data))
        try:
            load_weights(bad)
            outcomes["loaded"] += 1
        except CheckpointError as e:
            assert e.path == str(bad)
            outcomes["CheckpointError"] += 1
        bad.unlink()
    print(outcomes)
    assert outcomes["CheckpointError"] > 50


def _rewrite(src: Path, dst: Path, edit) -> None:  # type: ignore[no-untyped-def]
    w = load_weights(src)
    write_gguf(dst, w, edit(plan(w, "F16", "Q8_0")), {})


def test_missing_tensor(good: Path, tmp_path: Path) -> None:
    out = tmp_path / "missing.gguf"
    _rewrite(good, out, lambda plans: [p for p in plans if p.name != "blk.1.attn_k.weight"])
    with pytest.raises(CheckpointError, match="missing tensor") as e:
        load_model(out)
    assert e.value.tensor == "blk.1.attn_k.weight" and e.value.path == str(out)


@dataclasses.dataclass
class RawPlan:  # bytes written as-is under a type gguf cannot decode
    name: str
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    nbytes: int
    note: str = ""

    def tofile(self, fh) -> None:  # type: ignore[no-untyped-def]
        fh.write(b"\0" * self.nbytes)


def test_unsupported_quant_type(good: Path, tmp_path: Path) -> None:
    out = tmp_path / "q81.gguf"
    Q81 = gguf.GGMLQuantizationType.Q8_1
    block, size = gguf.GGML_QUANT_SIZES[Q81]

    def edit(plans: list[TensorPlan]) -> list:  # type: ignore[type-arg]
        return [RawPlan(p.name, Q81, p.shape, int(np.prod(p.shape)) // block * size)
                if p.name == "blk.0.ffn_down_exps.weight" else p for p in plans]

    _rewrite(good, out, edit)
    with pytest.raises(CheckpointError, match="unsupported tensor type Q8_1") as e:
        load_model(out)
    assert e.value.tensor == "blk.0.ffn_down_exps.weight" and e.value.path == str(out)


def test_shape_disagrees_with_config(good: Path) -> None:
    cfg = GGUFFile(good).config()
    wrong = dataclasses.replace(cfg, moe_intermediate_size=cfg.moe_intermediate_size + 32)
    with pytest.raises(CheckpointError, match="does not match") as e:
        load_gguf_weights(good, config=wrong)
    assert e.value.tensor == "blk.0.ffn_gate_exps.weight"


def test_folder_with_two_gguf_files(good: Path) -> None:
    shutil.copyfile(good, good.with_name("other.gguf"))
    with pytest.raises(CheckpointError, match="2 GGUF files"):
        load_model(good.parent)


def test_convert_cli_errors(oracle_checkpoints, tmp_path: Path) -> None:
    folder, _ = oracle_checkpoints.get("mixtral", "per_expert")
    runner = CliRunner()
    r = runner.invoke(convert_gguf, ["--model", str(folder), "--out", str(tmp_path / "x.bin")])
    assert r.exit_code == 2 and "must end in .gguf" in r.output
    r = runner.invoke(convert_gguf, ["--model", str(folder), "--out", str(tmp_path / "x.gguf"), "--type", "Q4_K"])
    assert r.exit_code == 2 and "Q4_K" in r.output  # K-quants can be read, not written, in pure Python
    empty = tmp_path / "empty"
    empty.mkdir()
    r = runner.invoke(convert_gguf, ["--model", str(empty), "--out", str(tmp_path / "x.gguf")])
    assert r.exit_code == 2 and r.output.startswith("error: ") and "config.json" in r.output
    assert not list(tmp_path.glob("*.gguf*"))  # nothing half-written


def test_string_arrays_read_as_gguf_reads_them_and_a_cut_one_is_refused(tmp_path: Path) -> None:
    """Arrays of strings (a vocabulary, merges) are read by the fast path of ``_Reader`` into the same parts and
    contents as gguf-py's own reader (which took 9.5 s of a 13 s load for Qwen's 151,936 tokens); a file cut
    inside such an array is refused with the same clear error."""
    import gguf

    from moeswarm.model._gguf_read import _Reader

    words = ["", "a", "Ġthe", "日本語", "x" * 300] * 50
    path = tmp_path / "strings.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("tokenizer.ggml.tokens", words)
    w.add_string("one", "single")
    w.add_tensor("t", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, theirs = _Reader(str(path)), gguf.GGUFReader(str(path))
    for key in ("tokenizer.ggml.tokens", "one"):
        a, b = ours.fields[key], theirs.fields[key]
        assert a.types == b.types and a.data == b.data and a.contents() == b.contents(), key
        assert [(p.dtype, p.tobytes()) for p in a.parts] == [(p.dtype, p.tobytes()) for p in b.parts], key
    assert ours.fields["tokenizer.ggml.tokens"].contents() == words
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: data.index("Ġthe".encode()) + 2])  # inside the third string
    with pytest.raises(CheckpointError, match="cut short or damaged"):
        _Reader(str(cut))
