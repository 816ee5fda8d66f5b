"""llama.cpp itself, as an independent oracle for GGUF: its converter (``convert_hf_to_gguf.py``, from the
llama-cpp-python 0.3.36 sdist) and its runtime (llama-cpp-python, built in a separate virtualenv: it is not a
test dependency because it compiles llama.cpp for ~8 minutes).

Where they are: ``MOESWARM_LLAMA_CPP_SRC`` (the sdist's ``vendor/llama.cpp``) and ``MOESWARM_LLAMA_CPP_PYTHON``
(a python that imports ``llama_cpp``); by default the copies on the project's test machine.  A missing one
fails the test with this module's message (no skips), saying how to install it.

The tiny oracle checkpoints have no tokenizer, and llama.cpp's converter recognises a BPE tokenizer by
hashing its ids of a test text, so ``convert`` runs the converter unchanged except for its vocabulary
step: the file gets a plain SentencePiece-style vocabulary of ``vocab_size`` tokens (the 256 byte tokens,
then ``<tN>``), which llama.cpp loads.  Every tensor and hyper-parameter is llama.cpp's converter's own.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

SRC = os.environ.get("MOESWARM_LLAMA_CPP_SRC") or next(iter(sorted(
    glob.glob("/work/llama-sdist/llama_cpp_python-*/vendor/llama.cpp"))), "")
PYTHON = os.environ.get("MOESWARM_LLAMA_CPP_PYTHON") or "/work/bench-venv/bin/python"
HOW = ("llama.cpp is this test's oracle: set MOESWARM_LLAMA_CPP_SRC to llama-cpp-python 0.3.36's sdist "
       "vendor/llama.cpp (pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36) and "
       "MOESWARM_LLAMA_CPP_PYTHON to a python with llama-cpp-python==0.3.36 installed")

_CONVERT = r'''
import importlib.util, sys
src, folder, out, outtype = sys.argv[1:5]
sys.path.insert(0, src)
spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", src + "/convert_hf_to_gguf.py")
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
gguf = mod.gguf
TextModel = importlib.import_module("conversion").TextModel

def synthetic_vocab(self):
    n = self.hparams.get("vocab_size") or self.hparams.get("text_config", {}).get("vocab_size")
    tokens = [f"<0x{i:02X}>" for i in range(256)] + [f"<t{i}>" for i in range(256, n)]
    types = [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * (n - 256)
    self.gguf_writer.add_tokenizer_model("llama")
    self.gguf_writer.add_tokenizer_pre("default")
    self.gguf_writer.add_token_list(tokens)
    self.gguf_writer.add_token_scores([0.0] * n)
    self.gguf_writer.add_token_types(types)
    self.gguf_writer.add_add_bos_token(False)

def get_model_class(*args, **kwargs):
    cls = real(*args, **kwargs)  # its module is imported now: every class that sets a vocabulary is loaded
    todo, seen = [TextModel], set()
    while todo:
        c = todo.pop()
        if c not in seen:
            seen.add(c)
            if "set_vocab" in vars(c) or c is TextModel:
                c.set_vocab = synthetic_vocab
            todo.extend(c.__subclasses__())
    return cls

real = mod.get_model_class
mod.get_model_class = get_model_class
sys.argv = ["convert_hf_to_gguf.py", folder, "--outfile", out, "--outtype", outtype]
mod.main()
'''

_GREEDY = r'''
import json, sys
import numpy as np
import llama_cpp as lc
path, prompt, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
llm = lc.Llama(model_path=path, n_ctx=256, n_batch=256, n_threads=1, n_threads_batch=1, verbose=False)
vocab = llm.n_vocab()

def step(ids):
    llm.eval(ids)
    logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(vocab,))
    return int(np.argmax(logits)), logits.copy()

token, first = step(prompt)
tokens = [token]
while len(tokens) < n:
    tokens.append(step([tokens[-1]])[0])
print(json.dumps({"tokens": tokens, "first_logits": first.tolist()}))
'''


def _require() -> tuple[Path, str]:
    src = Path(SRC) if SRC else None
    if src is None or not (src / "convert_hf_to_gguf.py").is_file():
        raise AssertionError(f"llama.cpp's convert_hf_to_gguf.py not found ({SRC!r}). {HOW}")
    if not Path(PYTHON).is_file():
        raise AssertionError(f"no python with llama-cpp-python at {PYTHON!r}. {HOW}")
    return src, PYTHON


def convert(folder: Path, out: Path, outtype: str = "f32") -> Path:
    """llama.cpp's converter on ``folder`` (a transformers checkpoint) -> ``out``."""
    src, _ = _require()
    done = subprocess.run([sys.executable, "-c", _CONVERT, str(src), str(folder), str(out), outtype],
                          capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0 and out.is_file(), f"llama.cpp's converter failed:\n{done.stderr[-3000:]}"
    return out


def greedy(path: Path, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """llama.cpp's greedy tokens on ``path`` (prefill ``prompt``, then ``n - 1`` steps) and its logits
    after the prompt."""
    _, python = _require()
    done = subprocess.run([python, "-c", _GREEDY, str(path), json.dumps(prompt), str(n)], capture_output=True,
                          text=True, timeout=300, check=False, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    assert done.returncode == 0, f"llama.cpp could not run {path.name}:\n{done.stderr[-3000:]}"
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return out["tokens"], out["first_logits"]


def with_vocab(ours: Path, theirs: Path, out: Path) -> Path:
    """``ours`` (a convert-gguf file of a checkpoint without a tokenizer, which llama.cpp refuses) with the
    ``tokenizer.*`` keys of ``theirs`` (``convert``'s file of the same checkpoint): its tensors and every other
    key unchanged, byte for byte."""
    import gguf

    src, vocab = gguf.GGUFReader(ours), gguf.GGUFReader(theirs)
    writer = gguf.GGUFWriter(out, str(src.get_field(gguf.Keys.General.ARCHITECTURE).contents()))
    for reader, tokenizer in ((src, False), (vocab, True)):
        for field in reader.fields.values():
            if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
                continue
            if field.name.startswith("tokenizer.") == tokenizer:
                kind = field.types[0]
                sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
                writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for t in src.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in src.tensors:
        writer.write_tensor_data(t.data)
    writer.close()
    return out
