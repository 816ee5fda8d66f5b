"""What the family oracle tests do with the engine: run a reference's prompt (whole or in chunks)
and decode steps over the KV cache, measure how far a variant moves the logits, and load a
checkpoint with its config changed (a mechanism switched off, for the negative controls)."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from moeswarm.model import Model, SamplingParams, Weights, generate, load_weights


def run_engine(model: Model, ref: Any, chunk: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(prefill logits [T, V], decode logits [n, V]) for ``ref``'s prompt and decode tokens."""
    cache = model.new_cache()
    ids = ref.prompt_ids
    step = chunk or len(ids)
    prefill = np.concatenate([model.forward(np.asarray([ids[i : i + step]]), cache)[0] for i in range(0, len(ids), step)])
    decode = [model.forward(np.asarray([[t]]), cache)[0, -1] for t in ref.decode_tokens]
    return prefill, np.stack(decode)


def moved(model: Model, ref: Any) -> float:
    """The largest distance of ``model``'s logits from the reference's, prefill and decode."""
    prefill, decode = run_engine(model, ref)
    return float(max(np.abs(prefill - ref.prefill_logits).max(), np.abs(decode - ref.decode_logits).max()))


def variant(folder: Path, edit: Callable[[Weights], None] | None = None, **changes: Any) -> Model:
    """The checkpoint at ``folder`` with ``changes`` to its config (and ``edit`` to its weights)."""
    w = load_weights(folder)
    w.config = replace(w.config, **changes)
    if edit is not None:
        edit(w)
    return Model(w, backend="eager")


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (created if missing): one pytest-xdist worker at a time."""
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def shared_root(tmp_path_factory: Any, name: str) -> Path:
    """A folder of the run that every pytest-xdist worker sees (under the base temp's parent, which is
    the run's), so that what one worker builds there the other reads."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "oracle-shared" / name
    root.mkdir(parents=True, exist_ok=True)
    return root


class OracleCheckpoints:
    """The tiny checkpoints a family's ``oracle_*`` module builds (seed 0) and transformers' reference
    run on each (16-token prefill + 8 greedy decode steps), read-only, built once per run: the
    workers and every fixture asking for the same module's checkpoint share one folder
    (``shared_root``; the reference is pickled beside it, the first to ask builds it under a lock).
    ``get(*key)`` -> ``(folder, Reference)``; ``key`` is ``build_checkpoint``'s leading arguments
    (arch, layout; or none)."""

    def __init__(self, module: str, tmp_path_factory: Any) -> None:
        self.module, self.root = module, shared_root(tmp_path_factory, module)
        self._cache: dict[tuple[str, ...], tuple[Path, Any]] = {}

    @property
    def oracle(self) -> Any:
        import importlib

        return importlib.import_module(self.module)

    def get(self, *key: str) -> tuple[Path, Any]:
        if key not in self._cache:
            name = "-".join(key or ("checkpoint",))
            folder, done = self.root / name, self.root / f"{name}.reference.pickle"
            with locked(self.root / f"{name}.lock"):
                if done.exists():
                    reference = pickle.loads(done.read_bytes())
                else:
                    o = self.oracle
                    shutil.rmtree(folder, ignore_errors=True)  # a build that died half way
                    folder = o.build_checkpoint(*key, folder)
                    reference = o.reference_run(folder, o.PROMPT)
                    done.with_suffix(".part").write_bytes(pickle.dumps(reference))
                    done.with_suffix(".part").rename(done)
            self._cache[key] = (folder, reference)
        return self._cache[key]


class FamilyCheckpoints(OracleCheckpoints):
    """``OracleCheckpoints`` of a module whose checkpoints are keyed ``(arch, layout)``, the hub's
    ``per_expert`` layout unless told."""

    def get(self, arch: str, layout: str = "per_expert") -> tuple[Path, Any]:  # type: ignore[override]
        return super().get(arch, layout)


def copy_with_config(src: Path, dst: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    """A copy of checkpoint ``src`` at ``dst`` whose config.json ``edit`` changed in place."""
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    edit(raw)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def assert_matches_transformers(model: Model, ref: Any, chunk: int | None, tol: float) -> None:
    """The engine's prefill (whole, or in ``chunk``-token pieces) and cached decode logits within
    ``tol`` of transformers' (``ref``), and its greedy tokens equal to transformers'."""
    prefill, decode = run_engine(model, ref, chunk)
    assert np.abs(prefill - ref.prefill_logits).max() <= tol
    assert np.abs(decode - ref.decode_logits).max() <= tol
    tokens = list(generate(model, ref.prompt_ids, SamplingParams(max_new_tokens=len(ref.greedy_tokens))))
    assert tokens == ref.greedy_tokens


def run_batched(model: Model, seqs: list[list[list[int] | None]], pool: Any) -> list[np.ndarray]:
    """``forward_batch`` over ``pool`` (a ``CachePool``): sequence j's chunk i (None: not in that pass) goes
    into pass i beside the others' -> each sequence's logits at every position it was given."""
    from moeswarm.model.batch import Step, forward_batch

    caches = [pool.admit(sum(len(c) for c in chunks if c)) for chunks in seqs]
    out: list[list[np.ndarray]] = [[] for _ in seqs]
    for i in range(max(len(s) for s in seqs)):
        batch = [(j, Step(caches[j], chunks[i], all_logits=True))
                 for j, chunks in enumerate(seqs) if i < len(chunks) and chunks[i]]
        forward_batch(model, [s for _, s in batch])
        for j, step in batch:
            out[j].append(step.logits)
    for cache in caches:
        cache.release()
    return [np.concatenate(o) for o in out]


def around(rng: np.random.Generator, vocab: int, steps: int) -> list[list[list[int] | None]]:
    """Sequences batched around one of ``steps`` passes: longer chunks, a late joiner, one that leaves early."""
    return [
        [rng.integers(3, vocab, 9).tolist(), rng.integers(3, vocab, 1).tolist(), rng.integers(3, vocab, 6).tolist()],
        [None, None, rng.integers(3, vocab, 20).tolist()] + [rng.integers(3, vocab, 1).tolist()] * (steps - 3),
        [rng.integers(3, vocab, 2).tolist()] * steps,
    ]


def assert_batched_as_alone_and_as_transformers(
        model: Model, ref: Any, pool: Any, first: int = 3,
        others: Callable[[np.random.Generator, int, int], list[list[list[int] | None]]] = around, tol: float = 1e-4,
) -> None:
    """``ref``'s sequence as a chunked prefill (``first`` ids, then the rest of the prompt) and one token a pass,
    batched (``forward_batch`` over ``pool``) beside ``others(rng, vocab, passes)``: its logits equal its logits
    alone and transformers' within ``tol``, and every block of ``pool`` comes back."""
    ids, T = ref.sequence_ids, len(ref.prompt_ids)
    mine = [ids[:first], ids[first:T]] + [[t] for t in ids[T:]]
    seqs = others(np.random.default_rng(0), model.config.vocab_size, len(mine))
    batched = run_batched(model, [mine, *seqs], pool)[0]
    alone = run_batched(model, [mine], pool)[0]
    assert pool.free == pool.num_blocks  # every block came back
    assert np.abs(batched - alone).max() <= tol
    assert np.abs(batched - ref.all_logits).max() <= tol


def assert_same_weights(source: Weights, exact: Weights) -> None:
    """``exact`` (a lossless conversion of ``source``) holds the same tensors and experts, bit for bit:
    every backbone tensor, and every expert's matrices and biases (where the source has biases)."""
    assert set(exact.tensors) == set(source.tensors)
    for name, a in source.tensors.items():
        assert np.array_equal(np.asarray(exact.tensors[name]), a), name
    for L, layer in source.experts.items():
        for e, x in layer.items():
            for part in ("gate", "up", "down", "gate_bias", "up_bias", "down_bias"):
                if getattr(x, part) is not None:
                    assert np.array_equal(getattr(exact.experts[L][e], part), getattr(x, part)), (L, e, part)


def f16_matrices(model: Model) -> tuple[int, int]:
    """After a run: (F16/BF16 matrices computed from their stored bytes by ``_f16.StoredLinear``, float32 copies
    held of 2-byte matrices), over the backbone (but its routers) and the expert cache's entries."""
    from moeswarm.model._f16 import StoredLinear
    from moeswarm.model.experts import DecodedOnce
    from moeswarm.model.gguf import QuantizedTensor

    as_stored = copies = 0
    # not the routers: routing.router_logits multiplies by a float32 copy of the (experts x hidden) matrix, a few KiB
    backbone = {id(a): a for n, a in model.weights.tensors.items() if not n.endswith((".router", ".shared_gate"))}
    for a in backbone.values():
        if isinstance(a, QuantizedTensor) and a.qtype.name in ("F16", "BF16"):
            as_stored += isinstance(a._kernel, StoredLinear)
            copies += isinstance(a._kernel, np.ndarray)
        elif isinstance(a, DecodedOnce):
            as_stored += a.kernel is not None
            copies += a.kernel_nbytes > 0
    cache = getattr(model.experts, "cache", None)  # its entries: float32 copies, kernels, or computed as stored
    entries = [*cache._copies._items.values(), *cache._as_stored.values()] if cache is not None else []
    for w in entries:
        for m in (getattr(w, p, None) for p in ("gate", "up", "down")):
            as_stored += isinstance(m, StoredLinear)
            copies += isinstance(m, np.ndarray) and m.dtype == np.float32
    return as_stored, copies
