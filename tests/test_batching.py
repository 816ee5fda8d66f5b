"""Batched forward passes over block-allocated caches against transformers, and against each
sequence run alone; speculative sampling's verification step against the distribution it must keep."""

from __future__ import annotations

import numpy as np
import pytest
from engine_support import assert_batched_as_alone_and_as_transformers
from scipy import stats

from moeswarm.errors import ConfigError
from moeswarm.model import SamplingParams, load_model
from moeswarm.model.batch import CachePool, layer_specs
from moeswarm.model.generate import probs
from moeswarm.model.speculative import verify

TOL = 1e-4  # as tests/test_engine_oracle.py


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss",
                                  "glm_moe_dsa", "qwen3_5_moe"])  # the last two: their own caches, not paged
def test_batched_logits_match_transformers_and_running_alone(oracle_checkpoints, arch: str) -> None:
    folder, ref = oracle_checkpoints.get(arch, "packed")
    model = load_model(folder)
    pool = CachePool(layer_specs(model.config), 4 << 20, block_tokens=4)  # small blocks: many per sequence
    assert_batched_as_alone_and_as_transformers(model, ref, pool, tol=TOL)


def test_the_pool_refuses_what_it_cannot_hold(oracle_checkpoints) -> None:
    folder, _ = oracle_checkpoints.get("mixtral", "packed")
    specs = layer_specs(load_model(folder).config)
    with pytest.raises(ConfigError, match="holds no block"):
        CachePool(specs, 10, block_tokens=4)
    pool = CachePool(specs, 3 * CachePool(specs, 1 << 20, block_tokens=4).block_bytes, block_tokens=4)
    assert pool.num_blocks == 3
    with pytest.raises(ConfigError, match="raise --kv-cache"):
        pool.admit(13)
    a = pool.admit(8)
    assert a is not None and pool.free == 1
    assert pool.admit(4, headroom=1) is None and pool.admit(4) is not None
    assert not a.grow(9)  # the pool is dry: a keeps what it had
    a.release()
    assert pool.free == 2


# ---- speculative sampling ------------------------------------------------------------------------


def trust_every_draft(logits, draft, q, params, rng):  # type: ignore[no-untyped-def]
    """A wrong verifier (accepts every draft), to show the test below can fail."""
    return list(draft) + [int(rng.choice(logits.shape[1], p=probs(logits[len(draft)], params)))]


def resample_from_p(logits, draft, q, params, rng):  # type: ignore[no-untyped-def]
    """A wrong verifier: right acceptance test, but a rejected draft is replaced by a draw from p
    instead of the residual max(0, p - q), so the rejected token comes back too often."""
    out = []
    for i, d in enumerate(draft):
        p = probs(logits[i], params)
        if rng.random() * (1.0 if q is None else float(q[i][d])) < p[d]:
            out.append(int(d))
            continue
        return out + [int(rng.choice(p.size, p=p))]
    return out + [int(rng.choice(logits.shape[1], p=probs(logits[len(draft)], params)))]


def null_tv_quantile(expected: np.ndarray, N: int, level: float = 0.999, runs: int = 4000) -> float:
    """The ``level`` quantile of the total variation between N exact draws from the target joint
    and the joint itself: what a correct sampler scores, simulated, not guessed."""
    draws = np.random.default_rng(11).multinomial(N, expected / expected.sum(), size=runs)
    return float(np.quantile(0.5 * np.abs(draws - expected).sum(axis=1) / N, level))


def chi2_of_two_tokens(verifier, draft_kind: str,  # type: ignore[no-untyped-def]
                       N: int) -> tuple[float, float, float, float]:
    """The first two emitted tokens of a 5-token vocabulary against the target's joint
    p0(a) p1(b | a): -> (chi-square, its 0.999 quantile, total variation, the 0.999 quantile of
    the total variation of N exact draws)."""
    V = 5
    rng = np.random.default_rng(7)
    params = SamplingParams(temperature=1.0)
    logits0 = np.log(np.array([0.05, 0.4, 0.25, 0.2, 0.1]))
    logits1 = {a: np.log(rng.dirichlet(np.ones(V))) for a in range(V)}  # p1 depends on the first token
    bonus = np.log(np.full(V, 1.0 / V))
    q0 = np.array([0.6, 0.1, 0.1, 0.1, 0.1])  # a draft that loves token 0, which the target rarely picks
    observed = np.zeros(V * V)
    for _ in range(N):
        if draft_kind.startswith("point"):
            d0, d1, q = 0, 3, None
        else:
            d0, d1 = int(rng.choice(V, p=q0)), int(rng.integers(V))
            q = [q0, np.full(V, 1.0 / V)]
        # logits at [last] + draft: row 0 is p0; row 1 is p1 given the draft's first token; row 2 a bonus
        out = verifier(np.stack([logits0, logits1[d0], bonus]), [d0, d1], q, params, rng)
        if len(out) == 1:  # rejected at once: the second token comes from the next step, p1(. | out[0])
            out.append(int(rng.choice(V, p=probs(logits1[out[0]], params))))
        observed[out[0] * V + out[1]] += 1
    p0 = probs(logits0, params)
    expected = np.concatenate([p0[a] * probs(logits1[a], params) for a in range(V)]) * N
    keep = expected > 5
    assert keep.sum() >= 20
    chi2 = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return (chi2, float(stats.chi2.ppf(0.999, keep.sum() - 1)), float(0.5 * np.abs(observed - expected).sum() / N),
            null_tv_quantile(expected, N))


@pytest.mark.parametrize("draft_kind", ["point mass (prompt lookup)", "draft distribution"])
def test_verification_keeps_the_target_distribution(draft_kind: str) -> None:
    """Chi-square and total variation both under their 0.999 null quantiles (the TV one simulated
    from exact draws of the same size); two wrong verifiers are caught by the same bounds, one
    that trusts every draft and one that replaces a rejected draft from p, not the residual."""
    chi2, bound, tv, tv_bound = chi2_of_two_tokens(verify, draft_kind, 20_000)
    assert chi2 < bound and tv < tv_bound, (chi2, bound, tv, tv_bound)
    chi2, bound, tv, tv_bound = chi2_of_two_tokens(trust_every_draft, draft_kind, 4_000)
    assert chi2 > bound and tv > tv_bound, (chi2, bound, tv, tv_bound)  # the test can tell a wrong verifier
    chi2, bound, tv, tv_bound = chi2_of_two_tokens(resample_from_p, draft_kind, 10_000)
    assert chi2 > bound and tv > tv_bound, (chi2, bound, tv, tv_bound)


def test_greedy_verification_is_the_greedy_choice() -> None:
    logits = np.array([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    params, rng = SamplingParams(), np.random.default_rng(0)
    assert verify(logits, [1, 0], None, params, rng) == [1, 0, 2]  # both accepted, then the bonus
    assert verify(logits, [1, 2], None, params, rng) == [1, 0]  # the second rejected: the argmax instead
    assert verify(logits, [2, 0], None, params, rng) == [1]
