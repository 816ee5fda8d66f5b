"""The backbone's fused kernel calls (``moeswarm/model/_fused.py``) against one call per matrix, in one process.

Two models from the same quantized GGUF: one as loaded (q/k/v, dense MLPs and shared experts one onnxruntime call
each), one with ``fuse_backbone`` turned off (every backbone matrix its own call; the rest of the engine the same).
Decode tokens alternate between them, so both see the same machine load: on a shared machine the paired
difference is readable where fresh processes run minutes apart are not.

    python benchmarks/backbone_fusion.py MODEL.gguf [--tokens 200] [--threads 2]

Prints per-token medians of both, the paired median difference, and the onnxruntime calls of one step of each.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=200, help="decode tokens timed per model (after 32 untimed)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from moeswarm.model import _ort_session, load_model, transformer
    from moeswarm.model._qkernels import set_threads

    set_threads(args.threads)
    fused = load_model(args.model)
    real = transformer.fuse_backbone
    transformer.fuse_backbone = lambda *a, **k: {}  # type: ignore[assignment]
    try:
        plain = load_model(args.model)
    finally:
        transformer.fuse_backbone = real  # type: ignore[assignment]
    calls = [0]
    run, run_inputs = _ort_session.Session.run, _ort_session.Session.run_inputs

    def counted(method):  # type: ignore[no-untyped-def]
        def wrapper(self, arg):  # type: ignore[no-untyped-def]
            calls[0] += 1
            return method(self, arg)
        return wrapper

    _ort_session.Session.run, _ort_session.Session.run_inputs = counted(run), counted(run_inputs)  # type: ignore[method-assign]
    cases = {}
    for name, model in (("one call per matrix", plain), ("fused", fused)):
        cache = model.new_cache()
        token = int(model.forward(np.arange(3, 11)[None], cache, last_only=True)[0, -1].argmax())
        for _ in range(32):
            token = int(model.forward(np.array([[token]]), cache, last_only=True)[0, -1].argmax())
        calls[0] = 0
        token = int(model.forward(np.array([[token]]), cache, last_only=True)[0, -1].argmax())
        cases[name] = {"model": model, "cache": cache, "token": token, "calls": calls[0], "ms": []}
    _ort_session.Session.run, _ort_session.Session.run_inputs = run, run_inputs  # type: ignore[method-assign]
    names = list(cases)
    for i in range(args.tokens):
        for name in names if i % 2 else names[::-1]:
            c = cases[name]
            start = time.perf_counter()
            c["token"] = int(c["model"].forward(np.array([[c["token"]]]), c["cache"], last_only=True)[0, -1].argmax())
            c["ms"].append((time.perf_counter() - start) * 1e3)
    plain_ms, fused_ms = (np.array(cases[n]["ms"]) for n in names)
    print(f"{args.model}: {args.tokens} tokens each, alternating; load average {os.getloadavg()[0]:.1f}\n")
    print("| | onnxruntime calls / token | median ms/token |\n|---|---|---|")
    for name in names:
        print(f"| {name} | {cases[name]['calls']} | {np.median(cases[name]['ms']):.2f} |")
    print(f"\npaired median difference {np.median(plain_ms - fused_ms):.2f} ms/token (fused faster in "
          f"{np.mean(fused_ms < plain_ms) * 100:.0f}% of pairs); same last token: "
          f"{cases[names[0]]['token'] == cases[names[1]]['token']}")


if __name__ == "__main__":
    main()
