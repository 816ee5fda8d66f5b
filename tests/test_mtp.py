"""Multi-token prediction: MTP layers read as each family stores them give transformers' MtpModel
logits; drafting with them keeps greedy output and the sampling distribution exactly."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from oracle import PROMPT
from oracle_mtp import MTP_ARCHS, build_mtp_checkpoint, mtp_reference
from scipy import stats

from moeswarm.errors import ConfigError
from moeswarm.model import SamplingParams, generate, load_model, speculative
from moeswarm.model._mtp_run import mtp_forward, new_mtp_cache
from moeswarm.model.generate import probs
from moeswarm.model.speculative import MtpDraft, SpeculativeStats, generate_drafted


@pytest.fixture(scope="module")
def mtp_checkpoints(tmp_path_factory):  # type: ignore[no-untyped-def]
    built: dict[str, tuple] = {}

    def get(arch: str):  # type: ignore[no-untyped-def]
        if arch not in built:
            built[arch] = build_mtp_checkpoint(arch, tmp_path_factory.mktemp(f"mtp-{arch}"))
        return built[arch]

    return get


def _prompt(arch: str) -> list[int]:
    return (PROMPT * 6)[:80] if arch == "qwen3_5_moe" else PROMPT  # Qwen3.5: past one DeltaNet chunk


def _ours(model, ids: list[int], split: int | None = None) -> tuple[np.ndarray, np.ndarray]:  # type: ignore[no-untyped-def]
    hidden: list[np.ndarray] = []
    model.forward(np.asarray([ids]), model.new_cache(), hidden_out=hidden)
    h = hidden[0][0]
    cache, cut = new_mtp_cache(model.config), split or len(ids) - 1
    parts = [mtp_forward(model, 0, h[a:b], np.asarray(ids[a + 1 : b + 1]), cache, a + 1)[1]
             for a, b in ((0, cut), (cut, len(ids) - 1)) if b > a]
    return h, np.concatenate(parts)


@pytest.mark.parametrize("arch", MTP_ARCHS)
def test_mtp_logits_match_transformers(mtp_checkpoints, arch: str) -> None:
    """Every slot's MTP logits within 1e-4 of MtpModel's, in one pass and in two over the MTP
    cache; negative control: the eh_proj input halves swapped ([hidden, embedding], another
    family's order) is caught by the same comparison."""
    folder, main, mtp = mtp_checkpoints(arch)
    ids = _prompt(arch)
    model = load_model(folder)
    assert model.config.mtp_layers == 1 and model.config.all_layers == model.config.num_layers + 1
    L = model.config.num_layers
    assert model.weights.experts[L], "the MTP layer's routed experts are loaded as experts of layer n"
    hidden, ref = mtp_reference(mtp, main, ids)
    h, logits = _ours(model, ids)
    assert np.abs(h - hidden).max() <= 1e-4
    assert np.abs(logits - ref).max() <= 1e-4, np.abs(logits - ref).max()
    _, chunked = _ours(model, ids, split=len(ids) // 2)
    assert np.abs(chunked - ref).max() <= 1e-4
    H = model.config.hidden_size
    w = np.asarray(model.weights[f"{L}.mtp.eh_proj"], np.float32)
    model.weights.tensors[f"{L}.mtp.eh_proj"] = np.concatenate([w[:, H:], w[:, :H]], axis=1)
    _, wrong = _ours(model, ids)
    assert np.abs(wrong - ref).max() > 1e-2


def test_a_checkpoint_without_mtp_weights_loads_none(oracle_checkpoints) -> None:
    """DeepSeek-V3 configs may declare MTP layers the folder does not hold: none is read."""
    folder, _ = oracle_checkpoints.get("deepseek_v3", "per_expert")
    model = load_model(folder)
    assert model.config.mtp_layers == 0
    with pytest.raises(ConfigError, match="no multi-token-prediction layer"):
        MtpDraft(model)


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v32", "glm_moe_dsa", "mixtral"])
def test_mtp_greedy_speculative_equals_greedy(mtp_checkpoints, arch: str) -> None:
    folder, _, _ = mtp_checkpoints(arch)
    model = load_model(folder)
    params = SamplingParams(max_new_tokens=24)
    st = SpeculativeStats()
    fast = list(generate_drafted(model, PROMPT, params, MtpDraft(model), k=3, stats=st))
    assert fast == list(generate(model, PROMPT, params))
    assert st.drafted > 0 and st.steps < len(fast)  # drafts were proposed and verified k + 1 at a time


def test_qwen3_5_mtp_drafts_are_refused(mtp_checkpoints) -> None:
    """Qwen3.5's DeltaNet state cannot forget a rejected draft: a clear error, not wrong tokens."""
    folder, _, _ = mtp_checkpoints("qwen3_5_moe")
    model = load_model(folder)
    with pytest.raises(ConfigError, match="cannot be rolled back"):
        next(generate_drafted(model, PROMPT, SamplingParams(), MtpDraft(model)))


def _trust_every_draft(logits, draft, q, params, rng):  # type: ignore[no-untyped-def]
    return list(draft) + [int(rng.choice(logits.shape[1], p=probs(logits[len(draft)], params)))]


def _joint_chi2(model, N: int, monkeypatch) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """The first three sampled tokens (top-3 at temperature 1.5, two MTP drafts per step) against
    the target's joint p0(a) p1(b | a) p2(c | a, b) from the model's own forward passes."""
    params = SamplingParams(max_new_tokens=3, temperature=1.5, top_k=3)

    def p_next(prefix: list[int]) -> np.ndarray:
        return probs(model.forward(np.asarray([PROMPT + prefix]), model.new_cache(), last_only=True)[0, -1], params)

    expected: dict[tuple[int, ...], float] = {}
    p0 = p_next([])
    for a in np.flatnonzero(p0):
        p1 = p_next([int(a)])
        for b in np.flatnonzero(p1):
            p2 = p_next([int(a), int(b)])
            for c in np.flatnonzero(p2):
                expected[(int(a), int(b), int(c))] = p0[a] * p1[b] * p2[c] * N
    observed = dict.fromkeys(expected, 0)
    drafter = MtpDraft(model)
    for seed in range(N):
        out = tuple(generate_drafted(model, PROMPT, replace(params, seed=seed), drafter, k=2))
        observed[out] = observed.get(out, 0) + 1
    keys = [key for key in expected if expected[key] > 5]
    assert len(keys) >= 10
    # the rarer outcomes, and any the target never gives, pooled into one cell
    rest_expected, rest = N - sum(expected[k] for k in keys), N - sum(observed.get(k, 0) for k in keys)
    chi2 = sum((observed[k] - expected[k]) ** 2 / expected[k] for k in keys)
    if rest_expected >= 1:
        return chi2 + (rest - rest_expected) ** 2 / rest_expected, float(stats.chi2.ppf(0.999, len(keys)))
    # every outcome the target gives is a kept cell: one it never gives fails outright
    return (chi2 if rest == 0 else float("inf")), float(stats.chi2.ppf(0.999, len(keys) - 1))


def test_mtp_speculative_sampling_keeps_the_distribution(mtp_checkpoints, monkeypatch) -> None:
    """Chi-square under its 0.999 null quantile with MTP drafts; a verifier that trusts every draft
    (the MTP layer's own distribution) fails the same test."""
    model = load_model(mtp_checkpoints("mixtral")[0])
    chi2, bound = _joint_chi2(model, 1500, monkeypatch)
    assert chi2 < bound, (chi2, bound)
    monkeypatch.setattr(speculative, "verify", _trust_every_draft)
    chi2, bound = _joint_chi2(model, 600, monkeypatch)
    assert chi2 > bound, (chi2, bound)
