"""moeswarm vs llama.cpp on the same GGUF files: cold and steady tok/s, peak RSS, per-token profiles, interop.

Needs llama-cpp-python (``pip install -e '.[bench]'`` or ``pip install llama-cpp-python==0.3.36``: it
compiles llama.cpp, about 8 minutes on 2 cores) and llama.cpp's source for its converter
(``convert_hf_to_gguf.py`` ships in that package's sdist: ``pip download --no-deps --no-binary :all:
llama-cpp-python==0.3.36``, then unpack; pass ``--llama-src .../vendor/llama.cpp``, or let the script
download it, which also takes minutes because pip prepares the sdist's build environment).

Two models (``benchmarks/_llamacpp_models.py``):
* ``--depth 4`` (the default): a random Mixtral-shaped model (hidden 1024, 4 layers, 8 experts top-2, expert
  width 2816, Mixtral's 32000-token tokenizer); llama.cpp's converter writes F32 and F16, llama.cpp
  (``llama_model_quantize``) quantizes the F32 file to Q8_0, Q4_K_M and IQ4_XS.
* ``--depth real``: Qwen3-30B-A3B's layer (hidden 2048, 128 experts of 768, top-8, 151936-token vocabulary)
  built with transformers, ``--layers`` deep (default: as many as fit in 24 GiB at F16 beside both
  engines, ``layers_that_fit``: 11); the converter writes F16 (F32 only if ``--types`` names it), llama.cpp
  quantizes the F16 file to Q8_0, Q4_K_M and IQ4_XS.  The Hugging Face folder is deleted once F16 is written.

Each run is one engine in its own process (``benchmarks/_llamacpp_child.py``), alternating llama.cpp and
moeswarm, same file, prompt ids and threads, greedy; medians over ``--rounds``.  Per run:
* cold: wall time from starting the process to the 32nd token of a short prompt (``--cold-prompt`` ids):
  interpreter, imports, load and the first tokens, everything a person waits for (the file is in the page
  cache: both engines read it through the same mmap'd pages);
* steady: in the same process afterwards, prefill of ``--prefill`` ids and ``--decode`` greedy tokens;
* peak RSS of the process (``VmHWM``: ``ru_maxrss`` carries the parent's peak across fork + exec, so after the
  parent built a model every run read 1,405 MiB);
* in the first round, ``--profile-steps`` more decode steps profiled: llama.cpp's perf context, moeswarm
  under cProfile (functions by own time, ms per token).
Then interop the other way (4-layer model): ``moeswarm convert-gguf`` writes F32/F16/Q8_0 files and llama.cpp
loads them and decodes them greedily (on F32 its tokens must equal moeswarm's).

    python benchmarks/llamacpp.py [--depth 4|real] [--layers N] [--threads 2] [--rounds 3] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import sys

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--depth", choices=("4", "real"), default="4", help="the 4-layer Mixtral model or the real-depth one")
ap.add_argument("--layers", type=int, default=None, help="layers of the real-depth model (default: what fits)")
ap.add_argument("--threads", type=int, default=2, help="threads for both engines (llama.cpp, onnxruntime, OpenBLAS)")
ap.add_argument("--rounds", type=int, default=3, help="alternating runs per engine and file (medians are reported)")
ap.add_argument("--decode", type=int, default=32, help="greedy tokens per steady run")
ap.add_argument("--prefill", type=int, default=64, help="prompt tokens (steady prefill is timed on this prompt)")
ap.add_argument("--cold-prompt", type=int, default=8, help="prompt tokens of the cold run (then 32 tokens)")
ap.add_argument("--profile-steps", type=int, default=8, help="decode steps profiled in the first round (0: none)")
ap.add_argument("--timeout", type=float, default=3600, help="seconds one engine run may take")
ap.add_argument("--keep", default=None, help="folder for the model and GGUF files (default: a temporary folder)")
ap.add_argument("--llama-src", default=None, help="llama.cpp source folder holding convert_hf_to_gguf.py and gguf-py")
ap.add_argument("--types", default=None, help="which llama.cpp files to compare "
                "(default: F32,F16,Q8_0,Q4_K_M,IQ4_XS; with --depth real F16,Q8_0,Q4_K_M,IQ4_XS)")
ap.add_argument("--small", action="store_true", help="a tiny model of the same family, to check the script quickly")
ap.add_argument("--no-interop", action="store_true", help="skip llama.cpp on convert-gguf's files")
ARGS = ap.parse_args()
REAL = ARGS.depth == "real"
TYPES = (ARGS.types or ("F16,Q8_0,Q4_K_M,IQ4_XS" if REAL else "F32,F16,Q8_0,Q4_K_M,IQ4_XS")).split(",")
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

sys.path.insert(0, str(Path(__file__).parent))
from _llamacpp_models import layers_that_fit, mixtral_folder, qwen3_moe_folder  # noqa: E402

FTYPES = {"Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "IQ4_XS": "LLAMA_FTYPE_MOSTLY_IQ4_XS"}
CHILD = Path(__file__).with_name("_llamacpp_child.py")


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


def hf_folder(work: Path, src: Path) -> Path:
    if not REAL:
        return mixtral_folder(work / "hf", ARGS.small)
    print(f"writing the real-depth model ({ARGS.layers} layers) with transformers' names and config", flush=True)
    return qwen3_moe_folder(work / "hf", ARGS.layers, ARGS.small, src)


def llama_file(work: Path, src: Path, name: str) -> Path:
    """llama.cpp's converter writes F32 and F16 (real depth: F16, F32 only if asked); llama.cpp quantizes
    the 4-layer model's F32 file and the real-depth model's F16 file to the rest."""
    lc = llama_cpp()
    out: dict[str, Path] = {}
    env = dict(os.environ, PYTHONPATH=f"{src / 'gguf-py'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    converted = (["F32"] if "F32" in TYPES else []) + ["F16"] if REAL else ["F32", "F16"]
    base = work / ("llama.F16.gguf" if REAL else "llama.F32.gguf")
    for outtype in converted:
        path = work / f"llama.{outtype}.gguf"
        if not path.exists():
            folder = hf_folder(work, src)
            print(f"llama.cpp convert_hf_to_gguf.py --outtype {outtype.lower()}", flush=True)
            subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(folder), "--outfile",
                            str(path) + ".part", "--outtype", outtype.lower()], check=True, env=env,
                           stdout=subprocess.DEVNULL)
            os.replace(str(path) + ".part", path)
        out[outtype] = path
    if REAL:  # regenerated from its seed if needed; 15 GB at 12 layers
        shutil.rmtree(work / "hf", ignore_errors=True)
    for q, ftype in FTYPES.items():
        path = work / f"llama.{q}.gguf"
        if q == name and not path.exists():
            print(f"llama.cpp quantize {base.name} -> {q}", flush=True)
            params = lc.llama_model_quantize_default_params()
            params.ftype = getattr(lc, ftype)
            params.nthread = ARGS.threads
            if lc.llama_model_quantize(str(base).encode(), (str(path) + ".part").encode(), params) != 0:
                raise RuntimeError(f"llama_model_quantize failed for {q}")
            os.replace(str(path) + ".part", path)
        out[q] = path
    return out[name]


# ---------------------------------------------------------------- one engine per process, alternating


def run(engine: str, path: Path, cold: list[int], prompt: list[int], profile: int) -> dict | None:  # type: ignore[type-arg]
    ids = (",".join(map(str, cold)), ",".join(map(str, prompt)))
    cmd = [sys.executable, str(CHILD), engine, str(path), repr(time.time()), str(ARGS.threads), *ids,
           str(ARGS.decode), str(profile)]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=ARGS.timeout)
    if done.returncode != 0:
        print(f"  {engine} on {path.name} failed ({done.returncode}): {done.stderr.strip()[-2000:]}", flush=True)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(name: str, path: Path, cold: list[int], prompt: list[int]) -> dict:  # type: ignore[type-arg]
    runs: dict[str, list[dict]] = {"llama": [], "ours": []}  # type: ignore[type-arg]
    for r in range(ARGS.rounds):  # alternate, so both see the same machine load
        for engine in ("llama", "ours") if r % 2 == 0 else ("ours", "llama"):
            result = run(engine, path, cold, prompt, ARGS.profile_steps if r == 0 else 0)
            if result is not None:
                runs[engine].append(result)
                print(f"  round {r + 1} {engine}: cold {result['cold_s']:.2f} s (imports {result['imported_s']:.2f} s, "
                      f"imports + load {result['load_s']:.2f} s), "
                      f"decode {result['decode_tok_s']:.2f} tok/s, prefill {result['prefill_tok_s']:.1f} tok/s, "
                      f"peak RSS {result['vmhwm_mib']:.0f} MiB", flush=True)
                print(f"  run {json.dumps(result)}", flush=True)  # everything, should a later run not finish
    return {"file": name, "MiB": path.stat().st_size / 2**20, "runs": runs}


def med(runs: list[dict], key: str) -> float:  # type: ignore[type-arg]
    return float(np.median([r[key] for r in runs])) if runs else float("nan")


def row(r: dict) -> str:  # type: ignore[type-arg]
    lr, our = r["runs"]["llama"], r["runs"]["ours"]
    if not lr or not our:
        return f"| {r['file']} | {r['MiB']:.0f} | failed: see the log above |"
    c = {e: 32 / med(v, "cold_s") for e, v in r["runs"].items()}
    d = {e: med(v, "decode_tok_s") for e, v in r["runs"].items()}
    p = {e: med(v, "prefill_tok_s") for e, v in r["runs"].items()}
    m = {e: med(v, "vmhwm_mib") for e, v in r["runs"].items()}
    a, b = lr[-1]["tokens"], our[-1]["tokens"]
    same = sum(x == y for x, y in zip(a, b))
    prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    return (f"| {r['file']} | {r['MiB']:.0f} | {med(lr, 'cold_s'):.2f} | {med(our, 'cold_s'):.2f} | "
            f"{c['ours'] / c['llama']:.2f}x | {d['llama']:.2f} | {d['ours']:.2f} | {d['ours'] / d['llama']:.2f}x | "
            f"{p['llama']:.1f} | {p['ours']:.1f} | {p['ours'] / p['llama']:.2f}x | {m['llama']:.0f} | {m['ours']:.0f} | "
            f"{m['ours'] / m['llama']:.2f}x | {same}/{len(a)} | {prefix}/{len(a)} |")


HEAD = ("| file | MiB | llama.cpp cold s | moeswarm cold s | cold ratio | llama.cpp decode tok/s | moeswarm decode "
        "tok/s | ratio | llama.cpp prefill tok/s | moeswarm prefill tok/s | ratio | llama.cpp peak RSS MiB | "
        "moeswarm peak RSS MiB | RSS ratio | greedy tokens equal | same prefix |")


def profiles(r: dict) -> list[str]:  # type: ignore[type-arg]
    lines = [f"\n{r['file']}, {ARGS.profile_steps} decode steps:"]
    for e in ("llama", "ours"):
        prof = next((x["profile"] for x in r["runs"][e] if "profile" in x), None)
        if prof is None:
            continue
        if e == "llama":
            lines.append(f"  llama.cpp perf context: load {prof['t_load_ms']:.0f} ms, eval "
                         f"{prof['eval_ms_per_token']:.2f} ms/token over {prof['n_eval']} tokens")
        else:
            lines.append(f"  moeswarm cProfile: {prof['ms_per_token']:.2f} ms/token (profiled); parts, ms/token:")
            lines += [f"    {ms:8.2f}  {label}" for label, ms in prof["sections"].items()]
            lines.append("  functions by own time, ms/token (own / cumulative, calls/token):")
            lines += [f"    {t['own_ms_per_token']:8.2f} / {t['cum_ms_per_token']:8.2f}  {t['calls_per_token']:7.1f}  "
                      f"{t['where']}" for t in prof["top_own"]]
    return lines


def interop(work: Path, folder: Path, prompt: list[int]) -> list[str]:
    """moeswarm convert-gguf -> llama.cpp loads it; on F32 its greedy tokens equal moeswarm's."""
    from moeswarm.model.gguf import convert_to_gguf

    lines = []
    for t in ("F32", "F16", "Q8_0"):
        path = work / f"moeswarm.{t}.gguf"
        if not path.exists():
            convert_to_gguf(folder, path, weight_type=t, sidecar=False)
        ours, theirs = run("ours", path, prompt[:8], prompt, 0), run("llama", path, prompt[:8], prompt, 0)
        if ours is None or theirs is None:
            lines.append(f"  {t}: a run failed (see above)")
            continue
        same = sum(a == b for a, b in zip(ours["tokens"], theirs["tokens"]))
        lines.append(f"  {t}: llama.cpp loads moeswarm's file; greedy tokens equal on {same}/{len(ours['tokens'])} "
                     f"({'identical' if ours['tokens'] == theirs['tokens'] else 'differ'})")
    return lines


def main() -> None:
    if REAL and ARGS.layers is None:
        ARGS.layers = 2 if ARGS.small else layers_that_fit()
    work = Path(ARGS.keep) if ARGS.keep else Path(tempfile.mkdtemp(prefix="moeswarm-llamacpp-"))
    work.mkdir(parents=True, exist_ok=True)
    src = llama_source(work)
    if REAL:
        print(f"real depth: Qwen3-30B-A3B's layer, {ARGS.layers} layers (layers_that_fit(24 GiB) = "
              f"{layers_that_fit()})", flush=True)
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 32000, ARGS.prefill).tolist()
    if not REAL:
        prompt[0] = 1  # <s>
    cold = prompt[:ARGS.cold_prompt]
    print(f"\n{ARGS.threads} threads; cold: {len(cold)}-id prompt, 32 tokens, wall time from process start; steady: "
          f"{ARGS.prefill}-id prefill, {ARGS.decode} greedy tokens; medians of {ARGS.rounds} alternating runs, "
          "each engine in its own process\n", flush=True)
    results = []
    for name in TYPES:
        print(f"{name}:", flush=True)
        results.append(compare(name, llama_file(work, src, name), cold, prompt))
        print(HEAD + "\n" + row(results[-1]), flush=True)
    print("\n" + HEAD + "\n" + "|---" * (HEAD.count("|") - 1) + "|")
    for r in results:
        print(row(r))
    if ARGS.profile_steps:
        print("\nper-token profiles (first round):")
        for r in results:
            print("\n".join(profiles(r)))
    if not ARGS.no_interop and not REAL:
        print("\nmoeswarm convert-gguf -> llama.cpp:")
        for line in interop(work, mixtral_folder(work / "hf", ARGS.small), prompt):
            print(line, flush=True)
    if not ARGS.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
