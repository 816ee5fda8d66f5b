"""Where one decode token's time goes: per-token profile of the engine on one model file, cold and steady.

A fresh process per run (so "cold" is what a person waits for: load, an 8-id prompt, the first tokens,
every expert's kernel built on its first use).  Each run times every decode token and counts, per token,
the onnxruntime runs (``Session.run``) and the seconds spent in each part of the step (attention,
router, routed experts, LM head, the rest), by wrapping those functions with a timer.

    python benchmarks/decode_profile.py MODEL.gguf [MODEL2 ...] [--tokens 64] [--threads 2] [--runs 3]
        [--tree before=/path/to/old/checkout --tree after=.]

``--tree NAME=DIR`` runs the engine from that source tree (``PYTHONPATH``), one case per tree and file, so
two versions are measured side by side in one run.  Kernel files (``X.gguf.kernels``) are deleted first, so
the first process of a tree that writes them pays that once: its load is shown apart.

Prints one table per file: cold (tokens 1-32 of a fresh process) and steady (tokens 33-N) medians in
ms/token and tok/s, onnxruntime runs per token, and the steady token's split by part, plus load time
and peak RSS (VmHWM).  Runs of the files alternate; medians over ``--runs`` processes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

_COLD = 32  # tokens counted as "cold": the first this many of a fresh process


def _child(model: str, tokens: int, threads: int) -> None:
    """One fresh process: load, prefill 8 ids, decode ``tokens`` greedily; prints one JSON line."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    t0 = time.perf_counter()
    import numpy as np

    from moeswarm.model import _ort_session, load_model, transformer
    from moeswarm.model._qkernels import set_threads

    set_threads(threads)
    parts: dict[str, float] = {}
    runs = [0]

    def timed(owner, name: str, part: str) -> None:  # type: ignore[no-untyped-def]
        fn = getattr(owner, name)

        def wrapper(*a, **k):  # type: ignore[no-untyped-def]
            s = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                parts[part] = parts.get(part, 0.0) + time.perf_counter() - s

        setattr(owner, name, wrapper)

    original_run, original_inputs = _ort_session.Session.run, _ort_session.Session.run_inputs

    def counted(self, x):  # type: ignore[no-untyped-def]
        runs[0] += 1
        return original_run(self, x)

    def counted_inputs(self, feeds):  # type: ignore[no-untyped-def]  # a layer's QMoE call
        runs[0] += 1
        return original_inputs(self, feeds)

    _ort_session.Session.run = counted  # type: ignore[method-assign]
    if hasattr(_ort_session.Session, "run_inputs"):
        _ort_session.Session.run_inputs = counted_inputs  # type: ignore[method-assign]
    timed(transformer, "gqa", "attention")
    timed(transformer, "route", "router")
    timed(transformer.LocalExperts, "submit", "routed experts")
    timed(transformer, "rms_norm", "norms")
    timed(transformer, "mm", "lm head")  # the forward pass calls mm only for the LM head
    model = load_model(model)
    loaded = time.perf_counter() - t0
    cache = model.new_cache()
    prompt = np.arange(3, 11)[None]
    s = time.perf_counter()
    logits = model.forward(prompt, cache, last_only=True)
    prefill = time.perf_counter() - s
    per_token, split, ort_runs = [], [], []
    token = int(logits[0, -1].argmax())
    for _ in range(tokens):
        parts.clear()
        runs[0] = 0
        s = time.perf_counter()
        logits = model.forward(np.array([[token]]), cache, last_only=True)
        token = int(logits[0, -1].argmax())
        per_token.append(time.perf_counter() - s)
        split.append(dict(parts))
        ort_runs.append(runs[0])
    hwm = next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
               if line.startswith("VmHWM:"))
    print(json.dumps({"load_s": loaded, "prefill_s": prefill, "per_token_s": per_token, "split": split,
                      "ort_runs": ort_runs, "peak_rss": hwm, "last_token": token}))


def _run(model: str, tokens: int, threads: int, tree: str) -> dict:  # type: ignore[type-arg]
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    out = subprocess.run([sys.executable, __file__, "--child", model, "--tokens", str(tokens), "--threads",
                          str(threads)], capture_output=True, text=True, check=True, timeout=1200, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _table(name: str, results: list[dict]) -> str:  # type: ignore[type-arg]
    def med(values: list[float]) -> float:
        return statistics.median(values)

    cold = med([med(r["per_token_s"][:_COLD]) for r in results]) * 1e3
    cold_mean = med([statistics.fmean(r["per_token_s"][:_COLD]) for r in results]) * 1e3
    steady = med([med(r["per_token_s"][_COLD:]) for r in results]) * 1e3
    runs = med([med(r["ort_runs"][_COLD:]) for r in results])
    parts = sorted({p for r in results for s in r["split"] for p in s})
    lines = [f"### {name}", "",
             (f"load {med([r['load_s'] for r in results]):.2f} s, 8-id prefill "
              f"{med([r['prefill_s'] for r in results]) * 1e3:.0f} ms, "
              f"peak RSS {med([r['peak_rss'] for r in results]) / 2**20:.0f} MiB, {len(results)} processes "
              f"(the first loaded in {results[0]['load_s']:.2f} s)"), "",
             "| | ms/token | tok/s |", "|---|---|---|",
             f"| cold: first {_COLD} tokens, mean (what a person waits) | {cold_mean:.2f} | {1e3 / cold_mean:.1f} |",
             f"| cold: first {_COLD} tokens, median | {cold:.2f} | {1e3 / cold:.1f} |",
             f"| steady: tokens {_COLD + 1}+, median | {steady:.2f} | {1e3 / steady:.1f} |", "",
             f"steady token split (median ms/token; onnxruntime runs per token: {runs:.0f})", "",
             "| part | ms |", "|---|---|"]
    total = steady
    for p in parts:
        ms = med([med([s.get(p, 0.0) for s in r["split"][_COLD:]]) for r in results]) * 1e3
        lines.append(f"| {p} | {ms:.2f} |")
        total -= ms
    lines.append(f"| rest (embedding, residuals, Python) | {total:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tree", action="append", default=[], help="NAME=DIR: a source tree to run (repeatable)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.models[0], args.tokens, args.threads)
        return
    if args.tokens <= _COLD:
        ap.error(f"--tokens must exceed {_COLD} (the cold tokens)")
    trees = dict(t.split("=", 1) for t in args.tree) or {"this tree": os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))}
    for m in args.models:
        Path(m + ".kernels").unlink(missing_ok=True)
    results: dict[str, list] = {f"{m} ({t})": [] for m in args.models for t in trees}  # type: ignore[type-arg]
    for _ in range(args.runs):  # cases alternate
        for m in args.models:
            for t, tree in trees.items():
                results[f"{m} ({t})"].append(_run(m, args.tokens, args.threads, tree))
    print(f"decode profile, {args.threads} onnxruntime threads, OPENBLAS_NUM_THREADS=1, "
          f"{args.tokens} tokens after an 8-id prompt; machine shared with other jobs (medians)\n")
    for m, rs in results.items():
        print(_table(m, rs), "\n")


if __name__ == "__main__":
    main()
