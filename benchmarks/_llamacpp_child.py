"""One engine on one GGUF file in its own process, for ``benchmarks/llamacpp.py``: prints one JSON line.

    python benchmarks/_llamacpp_child.py ENGINE FILE SPAWNED THREADS COLD_IDS PROMPT_IDS DECODE [PROFILE_STEPS]

ENGINE is ``llama`` (llama-cpp-python) or ``ours`` (moeswarm); SPAWNED is the parent's ``time.time()`` just
before it started this process, so the cold figure counts interpreter start, imports and model load:
everything a person waits for.  COLD_IDS and PROMPT_IDS are comma-separated token ids.

1. cold: load the file, prefill the short prompt, decode greedily until 32 tokens exist (the prefill's
   token is the first); ``cold_s`` is the wall time from SPAWNED to the 32nd token, ``imported_s`` to the
   engine's package imported, ``load_s`` to the model loaded.
2. steady: a fresh context/KV cache, prefill PROMPT_IDS (timed), DECODE greedy tokens (timed).  The cold
   run has already touched the weights, compiled graphs and filled caches.
3. peak RSS: /proc/self/status ``VmHWM`` of this process (and ``ru_maxrss``, which Linux carries over from the
   parent across fork + exec: not this process's own peak).
4. with PROFILE_STEPS > 0, that many more decode steps profiled: llama.cpp's own perf context
   (``llama_perf_context``: load, prompt and eval ms), moeswarm's under cProfile (functions by own time).
"""

from __future__ import annotations

import os
import sys

ENGINE, FILE, SPAWNED, THREADS = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
COLD_IDS = [int(t) for t in sys.argv[5].split(",")]
PROMPT_IDS = [int(t) for t in sys.argv[6].split(",")]
DECODE = int(sys.argv[7])
PROFILE_STEPS = int(sys.argv[8]) if len(sys.argv) > 8 else 0
COLD_TOKENS = 32
os.environ["OPENBLAS_NUM_THREADS"] = str(THREADS)  # before numpy is imported

import json  # noqa: E402
import resource  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import numpy as np  # noqa: E402


class Llama:
    def __init__(self) -> None:
        import llama_cpp as lc

        self.imported = time.time() - SPAWNED
        self.lc = lc
        self.llm = lc.Llama(model_path=FILE, n_ctx=512, n_batch=512, n_threads=THREADS, n_threads_batch=THREADS,
                            verbose=False)
        self.vocab = self.llm.n_vocab()

    def reset(self) -> None:
        self.llm.reset()  # eval() then drops the KV cells past position 0

    def step(self, ids: list[int]) -> int:
        """Feed ``ids`` at the next positions; the greedy token after the last one."""
        self.llm.eval(ids)
        ptr = self.lc.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(self.vocab,))))

    def profile(self, steps: int, last: int) -> dict[str, object]:
        lc, ctx = self.lc, self.llm._ctx.ctx
        lc.llama_perf_context_reset(ctx)
        for _ in range(steps):
            last = self.step([last])
        p = lc.llama_perf_context(ctx)
        return {"kind": "llama_perf_context", "t_load_ms": p.t_load_ms, "t_p_eval_ms": p.t_p_eval_ms,
                "n_p_eval": p.n_p_eval, "t_eval_ms": p.t_eval_ms, "n_eval": p.n_eval,
                "eval_ms_per_token": p.t_eval_ms / max(p.n_eval, 1)}


class Ours:
    def __init__(self) -> None:
        from moeswarm.model import load_model
        from moeswarm.model._qkernels import set_threads

        self.imported = time.time() - SPAWNED
        set_threads(THREADS)
        self.model = load_model(FILE)
        self.cache = self.model.new_cache()

    def reset(self) -> None:
        self.cache = self.model.new_cache()

    def step(self, ids: list[int]) -> int:
        logits = self.model.forward(np.asarray([ids]), self.cache, last_only=True)
        return int(logits[0, -1].argmax())

    def profile(self, steps: int, last: int) -> dict[str, object]:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(steps):
            last = self.step([last])
        prof.disable()
        wall = time.perf_counter() - t0
        stats = pstats.Stats(prof)
        rows = []
        for (path, line, func), (_, calls, own, cum, _) in stats.stats.items():  # type: ignore[attr-defined]
            where = func if path == "~" else f"{os.path.basename(path)}:{line} {func}"
            rows.append((own, cum, calls, where))
        rows.sort(reverse=True)
        return {"kind": "cProfile", "ms_per_token": 1e3 * wall / steps, "sections": sections(stats.stats, steps),  # type: ignore[attr-defined]
                "top_own": [{"where": w, "own_ms_per_token": 1e3 * o / steps, "cum_ms_per_token": 1e3 * c / steps,
                             "calls_per_token": n / steps} for o, c, n, w in rows[:14]]}


# a decode step's parts, by cumulative time: label -> (file's basename, function name) pairs, summed; for
# each pair the outermost function of that name counts ("~": a C function whose name contains it)
SECTIONS = {
    "attention (gqa)": (("attention.py", "gqa"),),
    "router": (("routing.py", "route"),),
    "routed experts (backend call)": (("transformer.py", "submit"),),
    "  of which expert cache lookups (F32Cache.get: fp16 -> fp32 expert copies)": (("experts.py", "get"),),
    "  of which repacks at first use (packed() + QExpertFFN built: onnxruntime sessions)":
        (("_gguf_tensor.py", "packed"), ("_qkernels.py", "__init__")),
    "onnxruntime runs (routed experts and quantized backbone matrices)": (("~", "onnxruntime_pybind11_state.run"),),
    "rms norms": (("attention.py", "rms_norm"),),
}


def sections(stats: dict, steps: int) -> dict[str, float]:  # type: ignore[type-arg]
    """ms per token of each part of ``SECTIONS`` and of the output matrix (``mm`` called from ``forward``)."""
    out: dict[str, float] = {}
    for label, pairs in SECTIONS.items():
        total = 0.0
        for base, func in pairs:
            cums = [v[3] for (path, _, name), v in stats.items()
                    if (name == func and os.path.basename(path) == base) or (base == path == "~" and func in name)]
            total += max(cums, default=0.0)
        out[label] = 1e3 * total / steps
    head = sum(ct for (path, _, name), v in stats.items() if name == "mm" and path.endswith("experts.py")
               for (cpath, _, cname), (_, _, _, ct) in v[4].items() if cname == "forward" and cpath.endswith("transformer.py"))
    out["output matrix (lm_head)"] = 1e3 * head / steps
    return out


def greedy(step: Callable[[list[int]], int], prompt: list[int], n: int) -> tuple[list[int], float, float]:
    """Prefill ``prompt`` then ``n - 1`` single-token steps -> (n tokens, prefill s, decode s)."""
    t0 = time.perf_counter()
    tokens = [step(prompt)]
    t1 = time.perf_counter()
    while len(tokens) < n:
        tokens.append(step([tokens[-1]]))
    return tokens, t1 - t0, time.perf_counter() - t1


def peak_rss_mib() -> tuple[float, float]:
    with open("/proc/self/status") as status:
        hwm = next((int(line.split()[1]) for line in status if line.startswith("VmHWM:")), 0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, hwm / 1024


def main() -> None:
    engine = Llama() if ENGINE == "llama" else Ours()
    loaded = time.time() - SPAWNED
    cold_tokens, _, _ = greedy(engine.step, COLD_IDS, COLD_TOKENS)
    cold = time.time() - SPAWNED
    engine.reset()
    tokens, prefill, decode = greedy(engine.step, PROMPT_IDS, DECODE)
    out: dict[str, object] = {"engine": ENGINE, "imported_s": engine.imported, "load_s": loaded, "cold_s": cold, "cold_tokens": cold_tokens,
                              "prefill_tok_s": len(PROMPT_IDS) / prefill, "decode_tok_s": (DECODE - 1) / decode,
                              "tokens": tokens}
    if PROFILE_STEPS:
        out["profile"] = engine.profile(PROFILE_STEPS, tokens[-1])
    out["maxrss_mib"], out["vmhwm_mib"] = peak_rss_mib()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
