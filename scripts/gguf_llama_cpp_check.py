"""llama.cpp's runtime on GGUF files, by hand (not in the test suite: llama-cpp-python compiles llama.cpp for
~8 minutes).  For each family of tests/gguf/test_gguf_llama_cpp_files.py, on its tiny transformers oracle
checkpoint (F32): llama.cpp (llama-cpp-python) on ``convert-gguf``'s file, and on llama.cpp's own converter's
file, prefills the prompt and decodes greedily; the tokens must be transformers' and the logits after the
prompt within 1e-3 of the largest (llama.cpp's own kernels and summation order).  convert-gguf's file gets
the vocabulary keys of llama.cpp's file of the same checkpoint (``with_vocab``: the tiny checkpoints have no
tokenizer, which llama.cpp refuses); its tensors and every other key are unchanged.

    MOESWARM_LLAMA_CPP_PYTHON=/path/to/venv/bin/python python scripts/gguf_llama_cpp_check.py [family ...]

Run it with the python that has the test dependencies (torch, transformers: it builds the oracle
checkpoints); ``MOESWARM_LLAMA_CPP_PYTHON`` is a python with ``llama-cpp-python==0.3.36`` (default: this one,
if it imports ``llama_cpp``).  llama.cpp's converter comes as in the tests (``llama_cpp_tools.converter_source``).
Prints one line per family and a summary; exits 1 if a file llama.cpp should run as transformers does not.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "gguf")]

import llama_cpp_tools
import numpy as np
from engine_support import OracleCheckpoints
from test_gguf_llama_cpp_files import CASES, CONVERTER_OPTIONS, for_converter

from moeswarm.model.gguf import convert_to_gguf

LLAMA_CPP_REL = 1e-3  # llama.cpp's F32 logits against transformers', relative to the largest
# Where llama.cpp does not run its own converter's file as transformers does (it runs convert-gguf's):
OWN_FILE_DIFFERS = {
    # its converter writes no expert_gating_func for dots1 and llama.cpp aborts ("llama-graph.cpp:2072: fatal
    # error"); convert-gguf writes the key (sigmoid)
    "dots1": "llama.cpp aborts: its converter writes no expert_gating_func",
    # on its absorbed-MLA file (attn_k_b / attn_v_b) llama.cpp's first token is transformers' but its decode
    # steps are not ([280, 438, ...] for [280, 379, ...])
    "deepseek_v3": "llama.cpp's decode steps on its absorbed-MLA file differ",
    # its converter takes the leading dense layers from first_k_dense_replace, which transformers 5.24's
    # Glm4MoeLiteConfig does not save (it has mlp_layer_types): leading_dense_block_count 0, and llama.cpp then
    # looks for blk.0.ffn_gate_inp ("check_tensor_dims: tensor 'blk.0.ffn_gate_inp.weight' not found");
    # convert-gguf writes the count from the layers (the engine reads either file: dense layers from the tensors)
    "glm4_moe_lite": "llama.cpp refuses it: its converter writes leading_dense_block_count 0",
}

# Where llama.cpp's runtime cannot express the checkpoint, whichever converter wrote the file:
RUNTIME_CANNOT = {
    # a dense layer after a MoE one: llama.cpp's deepseek2 runs dense layers only before the first MoE one
    "glm4_moe_lite_dense_between": "llama.cpp's deepseek2 has no dense layer after a MoE one",
    # llama.cpp's phimoe is its phi3 graph: RMSNorm (plus the bias) where PhiMoE has LayerNorm, and a softmax
    # top-2 where PhiMoE's sparsemixer weighs each choice by its own masked softmax
    "phimoe": "llama.cpp's phimoe: RMSNorm for LayerNorm, softmax top-2 for sparsemixer",
}

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


def llama_cpp_python() -> str:
    python = os.environ.get("MOESWARM_LLAMA_CPP_PYTHON")
    if python:
        if not Path(python).is_file():
            sys.exit(f"MOESWARM_LLAMA_CPP_PYTHON={python}: no such file")
        return python
    if importlib.util.find_spec("llama_cpp") is None:
        sys.exit("llama.cpp's runtime is needed: set MOESWARM_LLAMA_CPP_PYTHON to a python with "
                 f"llama-cpp-python=={llama_cpp_tools.VERSION} installed (pip install llama-cpp-python=="
                 f"{llama_cpp_tools.VERSION}: it compiles llama.cpp, ~8 minutes)")
    return sys.executable


def greedy(python: str, path: Path, prompt: list[int], n: int) -> tuple[list[int] | None, np.ndarray | None, str]:
    """llama.cpp's greedy tokens on ``path`` (prefill ``prompt``, then ``n - 1`` steps) and its logits after
    the prompt; (None, None, its error) if it fails."""
    done = subprocess.run([python, "-c", _GREEDY, str(path), json.dumps(prompt), str(n)], capture_output=True,
                          text=True, timeout=300, check=False, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit {done.returncode}"]
        return None, None, next((x for x in lines if "error" in x.lower()), lines[-1])[-90:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return out["tokens"], np.asarray(out["first_logits"]), ""


def with_vocab(ours: Path, theirs: Path, out: Path) -> Path:
    """``ours`` (a convert-gguf file of a checkpoint without a tokenizer, which llama.cpp refuses) with the
    ``tokenizer.*`` keys of ``theirs`` (llama.cpp's converter's file of the same checkpoint): its tensors and
    every other key unchanged, byte for byte."""
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


def check(python: str, src: Path, root: Path, oracles: dict[str, OracleCheckpoints], family: str) -> tuple[str, bool]:
    module, *key = CASES[family]
    if module not in oracles:
        oracles[module] = OracleCheckpoints(module, root / module)
    folder, ref = oracles[module].get(*key)
    work = root / "files" / family
    work.mkdir(parents=True)
    source = for_converter(family, folder, work / "hub-form")
    theirs = llama_cpp_tools.convert(src, source, work / "llama.cpp.gguf", "f32", *CONVERTER_OPTIONS.get(family, ()))
    ours = convert_to_gguf(folder, work / "ours.gguf", weight_type="F32", sidecar=False).path
    last = ref.prefill_logits[-1]
    parts, ok = [], True
    for label, path in (("convert-gguf", with_vocab(ours, theirs, work / "ours+vocab.gguf")), ("llama.cpp's", theirs)):
        tokens, first, error = greedy(python, path, list(ref.prompt_ids), len(ref.greedy_tokens))
        if tokens is None:
            verdict = f"fails ({error})"
            same = False
        else:
            rel = float(np.abs(first - last).max() / np.abs(last).max())
            same = tokens == ref.greedy_tokens and rel <= LLAMA_CPP_REL
            verdict = f"{'same' if tokens == ref.greedy_tokens else 'OTHER'} tokens, logits {rel:.1e}"
        known = RUNTIME_CANNOT.get(family) or (OWN_FILE_DIFFERS.get(family) if label != "convert-gguf" else None)
        expected = known is None
        if not same and not expected:
            verdict += f" [known: {known}]"
        ok = ok and (same or not expected)
        parts.append(f"{label} file: {verdict}")
    return f"{family:18s} {'ok  ' if ok else 'FAIL'} " + "; ".join(parts), ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("families", nargs="*", help=f"default: all ({', '.join(CASES)})")
    args = parser.parse_args()
    if unknown := set(args.families) - set(CASES):
        parser.error(f"no such family: {', '.join(sorted(unknown))} (families: {', '.join(CASES)})")
    python = llama_cpp_python()
    src = llama_cpp_tools.converter_source()
    families = args.families or list(CASES)
    results = []
    with tempfile.TemporaryDirectory(prefix="gguf-llama-cpp-") as tmp:
        oracles: dict[str, OracleCheckpoints] = {}
        for family in families:
            line, ok = check(python, src, Path(tmp), oracles, family)
            print(line, flush=True)
            results.append(ok)
    print(f"{sum(results)}/{len(results)} families: llama.cpp gives transformers' greedy tokens (logits within "
          f"{LLAMA_CPP_REL:g} of the largest) on convert-gguf's file, and on llama.cpp's own but for "
          f"{', '.join(sorted(set(OWN_FILE_DIFFERS) & set(families))) or 'none'} (known); llama.cpp cannot run "
          f"{', '.join(sorted(set(RUNTIME_CANNOT) & set(families))) or 'none'} (known)")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
