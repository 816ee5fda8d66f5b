"""moeswarm vs llama.cpp on the same GGUF files: decode and prefill tok/s, greedy agreement, interop.

Needs llama-cpp-python (``pip install -e '.[bench]'`` or ``pip install llama-cpp-python==0.3.36``: it
compiles llama.cpp, about 8 minutes on 2 cores) and llama.cpp's source for its converter
(``convert_hf_to_gguf.py`` ships in that package's sdist: ``pip download --no-deps --no-binary :all:
llama-cpp-python==0.3.36``, then unpack; pass ``--llama-src .../vendor/llama.cpp``, or let the script
download it, which also takes minutes because pip prepares the sdist's build environment).

What it does:
1. writes a random Mixtral-shaped model (hidden 1024, 4 layers, 8 experts top-2, expert width 2816,
   Mixtral's 32000-token SentencePiece tokenizer from mistral-common) as a Hugging Face folder;
2. converts it with llama.cpp's own converter to F32 and F16, quantizes the F32 file with llama.cpp
   (``llama_model_quantize``) to Q8_0, Q4_K_M and IQ4_XS;
3. for each file, alternating llama.cpp and moeswarm runs (same prompt ids, same threads, greedy), the
   median decode and prefill tok/s of each and their ratio, and how many greedy tokens agree;
4. interop the other way: ``moeswarm convert-gguf`` writes F32/F16/Q8_0 files and llama.cpp loads them
   and decodes them greedily (on F32 its tokens must equal moeswarm's).

    python benchmarks/llamacpp.py [--threads 2] [--rounds 3] [--decode 32] [--prefill 64] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import sys

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--threads", type=int, default=2, help="threads for both engines (llama.cpp, onnxruntime, OpenBLAS)")
ap.add_argument("--rounds", type=int, default=3, help="alternating runs per engine and file (medians are reported)")
ap.add_argument("--decode", type=int, default=32, help="greedy tokens per run")
ap.add_argument("--prefill", type=int, default=64, help="prompt tokens (prefill is timed on this prompt)")
ap.add_argument("--keep", default=None, help="folder for the model and GGUF files (default: a temporary folder)")
ap.add_argument("--llama-src", default=None, help="llama.cpp source folder holding convert_hf_to_gguf.py and gguf-py")
ap.add_argument("--types", default="F32,F16,Q8_0,Q4_K_M,IQ4_XS", help="which llama.cpp files to compare")
ap.add_argument("--small", action="store_true", help="a tiny model (hidden 256), to check the script quickly")
ap.add_argument("--no-interop", action="store_true", help="skip step 4 (llama.cpp on convert-gguf's files)")
ARGS = ap.parse_args()
os.environ["OPENBLAS_NUM_THREADS"] = str(ARGS.threads)  # before numpy is imported
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import glob  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tarfile  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from moeswarm.model import load_model  # noqa: E402
from moeswarm.model._qkernels import set_threads  # noqa: E402
from moeswarm.model.gguf import convert_to_gguf  # noqa: E402
from moeswarm.model.synthetic import random_mixtral  # noqa: E402

set_threads(ARGS.threads)
FTYPES = {"Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "IQ4_XS": "LLAMA_FTYPE_MOSTLY_IQ4_XS"}


def llama_cpp():  # type: ignore[no-untyped-def]
    try:
        import llama_cpp
    except ImportError:
        sys.exit("llama-cpp-python is missing: pip install llama-cpp-python==0.3.36 (compiles llama.cpp, ~8 min "
                 "on 2 cores)")
    return llama_cpp


def llama_source(work: Path) -> Path:
    if ARGS.llama_src:
        return Path(ARGS.llama_src)
    found = glob.glob(str(work / "sdist" / "llama_cpp_python-*" / "vendor" / "llama.cpp"))
    if found:
        return Path(found[0])
    print("downloading llama-cpp-python's sdist for convert_hf_to_gguf.py (pip prepares it: minutes)...", flush=True)
    (work / "sdist").mkdir(exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    "llama-cpp-python==0.3.36", "-d", str(work / "sdist")], check=True)
    with tarfile.open(next((work / "sdist").glob("llama_cpp_python-*.tar.gz"))) as tar:
        tar.extractall(work / "sdist", filter="data")
    return Path(glob.glob(str(work / "sdist" / "llama_cpp_python-*" / "vendor" / "llama.cpp"))[0])


def hf_model(work: Path) -> Path:
    import mistral_common

    folder = work / "hf"
    size = dict(hidden=256, inter=512, layers=2, heads=4, kv_heads=2) if ARGS.small else \
        dict(hidden=1024, inter=2816, layers=4, heads=16, kv_heads=4)
    if not (folder / "config.json").exists():
        random_mixtral(folder, experts=8, vocab=32000, **size)
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update(architectures=["MixtralForCausalLM"], rope_theta=1e6, bos_token_id=1, eos_token_id=2)
        (folder / "config.json").write_text(json.dumps(cfg, indent=2))
        shutil.copyfile(Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1", folder / "tokenizer.model")
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
             "tokenizer_class": "LlamaTokenizer", "model_max_length": 4096}))
    return folder


def llama_files(work: Path, folder: Path, src: Path) -> dict[str, Path]:
    lc = llama_cpp()
    out: dict[str, Path] = {}
    env = dict(os.environ, PYTHONPATH=f"{src / 'gguf-py'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    for outtype in ("f32", "f16"):
        path = work / f"llama.{outtype.upper()}.gguf"
        if not path.exists():
            print(f"llama.cpp convert_hf_to_gguf.py --outtype {outtype}", flush=True)
            subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(folder), "--outfile", str(path),
                            "--outtype", outtype], check=True, env=env, stdout=subprocess.DEVNULL)
        out[outtype.upper()] = path
    for name, ftype in FTYPES.items():
        path = work / f"llama.{name}.gguf"
        if not path.exists():
            print(f"llama.cpp quantize F32 -> {name}", flush=True)
            params = lc.llama_model_quantize_default_params()
            params.ftype = getattr(lc, ftype)
            params.nthread = ARGS.threads
            if lc.llama_model_quantize(str(out["F32"]).encode(), str(path).encode(), params) != 0:
                raise RuntimeError(f"llama_model_quantize failed for {name}")
        out[name] = path
    return out


# ---------------------------------------------------------------- the two engines, same protocol


class LlamaRunner:
    def __init__(self, path: Path) -> None:
        lc = llama_cpp()
        self.llm = lc.Llama(model_path=str(path), n_ctx=512, n_batch=512, n_threads=ARGS.threads,
                            n_threads_batch=ARGS.threads, verbose=False)
        self.lc, self.vocab = lc, self.llm.n_vocab()

    def last_logits(self) -> np.ndarray:
        """The last position's logits (llama-cpp-python keeps ``scores`` only with logits_all)."""
        ptr = self.lc.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.vocab,))

    def run(self, prompt: list[int], n: int) -> tuple[list[int], float, float]:
        """Greedy ``n`` tokens -> (tokens, prefill seconds, decode seconds for the n - 1 decode steps)."""
        llm = self.llm
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        t1 = time.perf_counter()
        tokens = [int(np.argmax(self.last_logits()))]
        for _ in range(n - 1):
            llm.eval([tokens[-1]])
            tokens.append(int(np.argmax(self.last_logits())))
        return tokens, t1 - t0, time.perf_counter() - t1


class OursRunner:
    def __init__(self, path: Path) -> None:
        self.model = load_model(path)

    def run(self, prompt: list[int], n: int) -> tuple[list[int], float, float]:
        m = self.model
        cache = m.new_cache()
        t0 = time.perf_counter()
        logits = m.forward(np.asarray([prompt]), cache, last_only=True)
        t1 = time.perf_counter()
        tokens = [int(logits[0, -1].argmax())]
        for _ in range(n - 1):
            tokens.append(int(m.forward(np.asarray([[tokens[-1]]]), cache, last_only=True)[0, -1].argmax()))
        return tokens, t1 - t0, time.perf_counter() - t1


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def compare(name: str, path: Path, prompt: list[int]) -> dict[str, float | str]:
    n = ARGS.decode
    llama, ours = LlamaRunner(path), OursRunner(path)
    for runner in (llama, ours):  # one untimed run: first-use repacking / conversion, page faults, graphs
        runner.run(prompt, n)
    times: dict[str, list[tuple[float, float]]] = {"llama": [], "ours": []}
    tokens: dict[str, list[int]] = {}
    for _ in range(ARGS.rounds):  # alternate, so both see the same machine load
        for key, runner in (("llama", llama), ("ours", ours)):
            toks, pre, dec = runner.run(prompt, n)
            times[key].append((len(prompt) / pre, (n - 1) / dec))
            tokens[key] = toks
    med = {k: (float(np.median([t[0] for t in v])), float(np.median([t[1] for t in v]))) for k, v in times.items()}
    same = sum(a == b for a, b in zip(tokens["llama"], tokens["ours"]))
    prefix = next((i for i, (a, b) in enumerate(zip(tokens["llama"], tokens["ours"])) if a != b), n)
    rss = rss_mib()
    del llama
    return {"file": name, "MiB": path.stat().st_size / 2**20, "llama_dec": med["llama"][1], "ours_dec": med["ours"][1],
            "llama_pre": med["llama"][0], "ours_pre": med["ours"][0], "agree": f"{same}/{n}",
            "prefix": f"{prefix}/{n}", "rss": rss}


def interop(work: Path, folder: Path, prompt: list[int]) -> list[str]:
    """moeswarm convert-gguf -> llama.cpp loads it; on F32 its greedy tokens equal moeswarm's."""
    lines = []
    for t in ("F32", "F16", "Q8_0"):
        path = work / f"moeswarm.{t}.gguf"
        if not path.exists():
            convert_to_gguf(folder, path, weight_type=t, sidecar=False)
        ours = OursRunner(path).run(prompt, ARGS.decode)[0]
        try:
            theirs = LlamaRunner(path).run(prompt, ARGS.decode)[0]
        except Exception as e:  # noqa: BLE001 - report whatever llama.cpp says
            lines.append(f"  {t}: llama.cpp could not load moeswarm's file: {type(e).__name__}: {e}")
            continue
        same = sum(a == b for a, b in zip(ours, theirs))
        lines.append(f"  {t}: llama.cpp loads moeswarm's file; greedy tokens equal on {same}/{len(ours)} "
                     f"({'identical' if ours == theirs else 'differ'})")
    return lines


def main() -> None:
    work = Path(ARGS.keep) if ARGS.keep else Path(tempfile.mkdtemp(prefix="moeswarm-llamacpp-"))
    work.mkdir(parents=True, exist_ok=True)
    folder = hf_model(work)
    files = llama_files(work, folder, llama_source(work))
    prompt = np.random.default_rng(0).integers(3, 32000, ARGS.prefill).tolist()
    prompt[0] = 1  # <s>
    print(f"\n{ARGS.threads} threads, prompt {ARGS.prefill} ids, {ARGS.decode} greedy tokens, medians of "
          f"{ARGS.rounds} alternating runs\n")
    head = ("| file | MiB | llama.cpp decode tok/s | moeswarm decode tok/s | ratio | llama.cpp prefill tok/s "
            "| moeswarm prefill tok/s | ratio | greedy tokens equal | same prefix | RSS MiB (both loaded) |")
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for name in ARGS.types.split(","):
        r = compare(name, files[name], prompt)
        print(f"| {r['file']} | {r['MiB']:.0f} | {r['llama_dec']:.1f} | {r['ours_dec']:.1f} | "
              f"{r['ours_dec'] / r['llama_dec']:.2f}x | {r['llama_pre']:.0f} | {r['ours_pre']:.0f} | "
              f"{r['ours_pre'] / r['llama_pre']:.2f}x | {r['agree']} | {r['prefix']} | {r['rss']:.0f} |", flush=True)
    if not ARGS.no_interop:
        print("\nmoeswarm convert-gguf -> llama.cpp:")
        for line in interop(work, folder, prompt):
            print(line, flush=True)
    if not ARGS.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
