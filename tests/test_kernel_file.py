"""The kernel file beside a GGUF (``X.gguf.kernels``, ``moeswarm.model._kernel_file``): its matrices are the
stored ones (each decodes to exactly what gguf-py's ``dequantize`` gives), a second process computes from it
without repacking anything, and a stale, cut or corrupt file is rebuilt with a warning, not a crash.

Before the kernel file every process repacked every matrix at its first use: the same model and prompt with the
kernel file switched off (``_gguf_read.attach_kernel_file`` replaced by a no-op, i.e. the old code path) printed
``repacks 33`` for the first load and ``repacks 33`` again for the second (2 layers x (4 attention + 4 experts x 3)
+ the LM head); ``test_second_process_does_not_repack`` asserts 0 for the second process.  The elementwise
logit bounds of the kernel path against gguf-py's decoding are those of ``tests/gguf/test_gguf_kernels.py``,
which now runs through the kernel file (it is on by default); here the file's matrices are checked exactly."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf.quants import dequantize

from moeswarm.model import _kernel_file, load_model, load_weights
from moeswarm.model._kernel_file import kernel_path
from moeswarm.model.gguf import QuantizedTensor, convert_to_gguf
from moeswarm.model.synthetic import random_mixtral

PROMPT = np.array([[3, 17, 250, 41]])

_CHILD = """
import json, sys
import numpy as np
from moeswarm.model import _kernel_file, _qkernels, load_model
m = load_model(sys.argv[1])
logits = m.forward(np.array([[3, 17, 250, 41]]), m.new_cache())
print(json.dumps({"builds": _kernel_file.BUILDS["count"], "repacks": _qkernels.REPACKS["count"],
                  "logits": logits[0, -1].tolist()}))
"""

@pytest.fixture(scope="module")
def q8_gguf(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    src = random_mixtral(tmp_path_factory.mktemp("kf") / "m", hidden=128, inter=256, layers=2, experts=4,
                         vocab=512, heads=4, kv_heads=2)
    out = src.parent / "q8" / "model.gguf"
    out.parent.mkdir()
    convert_to_gguf(src, out, weight_type="Q8_0", sidecar=False)
    return out

def _child(model: Path) -> dict:  # type: ignore[type-arg]
    out = subprocess.run([sys.executable, "-c", _CHILD, str(model)], capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])

def test_second_process_does_not_repack(q8_gguf: Path) -> None:
    kernel_path(q8_gguf).unlink(missing_ok=True)
    first = _child(q8_gguf)
    stat = os.stat(kernel_path(q8_gguf))
    second = _child(q8_gguf)
    assert first["builds"] == 1 and first["repacks"] > 0  # the first process wrote the file
    assert second["builds"] == 0 and second["repacks"] == 0  # the second repacked nothing
    after = os.stat(kernel_path(q8_gguf))
    assert (after.st_ino, after.st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns)
    assert first["logits"] == second["logits"]

def test_kernel_file_holds_the_stored_values(q8_gguf: Path) -> None:
    """Every matrix read from the file decodes to gguf-py's decoding of the stored blocks, exactly."""
    w = load_weights(q8_gguf)
    mats = [a for name, a in w.tensors.items() if isinstance(a, QuantizedTensor) and name != "embed"]  # rows only
    mats += [getattr(x, p) for layer in w.experts.values() for x in layer.values() for p in ("gate", "up", "down")]
    assert len(mats) == 2 * (4 + 4 * 3) + 1  # attention q/k/v/o and experts of 2 layers, and the LM head
    for a in mats:
        assert a._kernel_file is not None
        reference = dequantize(a.raw, a.qtype).reshape(a.shape)
        if a.rows is not None:
            reference = reference[a.rows]
        np.testing.assert_array_equal(a.packed().dequantize(), reference)

@pytest.mark.parametrize("damage", ["truncate", "header", "stale", "garbage"])
def test_damaged_kernel_file_is_rebuilt(q8_gguf: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    path = kernel_path(q8_gguf)
    reference = load_model(q8_gguf).forward(PROMPT, load_model(q8_gguf).new_cache())  # builds the file if missing
    if damage == "truncate":
        os.truncate(path, path.stat().st_size // 2)
    elif damage == "header":
        with open(path, "r+b") as f:
            f.seek(60)
            byte = f.read(1)
            f.seek(60)
            f.write(bytes([byte[0] ^ 0xFF]))
    elif damage == "stale":
        os.utime(q8_gguf, ns=(q8_gguf.stat().st_atime_ns, q8_gguf.stat().st_mtime_ns + 1_000_000_000))
    else:
        path.write_bytes(b"not a kernel file")
    builds = _kernel_file.BUILDS["count"]
    with caplog.at_level(logging.WARNING, logger="moeswarm.model._kernel_file"):
        model = load_model(q8_gguf)
    assert _kernel_file.BUILDS["count"] == builds + 1
    assert any(f"rebuilding the kernel file {path}" in r.getMessage() for r in caplog.records), caplog.text
    np.testing.assert_array_equal(model.forward(PROMPT, model.new_cache()), reference)
    assert _kernel_file.KernelFile(path, _kernel_file._sources([str(q8_gguf)])).keys()  # whole again

def test_read_only_folder_repacks_in_memory(q8_gguf: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    (folder / "model.gguf").write_bytes(q8_gguf.read_bytes())
    folder.chmod(0o555)
    try:
        if os.access(folder, os.W_OK):  # root ignores the mode: make the file path unwritable instead
            kernel_path(folder / "model.gguf").mkdir()
        with caplog.at_level(logging.WARNING, logger="moeswarm.model._kernel_file"):
            model = load_model(folder / "model.gguf")
        got = model.forward(PROMPT, model.new_cache())
    finally:
        folder.chmod(0o755)
    assert "repacked in memory at first use" in caplog.text
    reference = load_model(q8_gguf)
    np.testing.assert_array_equal(got, reference.forward(PROMPT, reference.new_cache()))
