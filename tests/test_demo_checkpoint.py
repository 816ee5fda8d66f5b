"""The shipped demo checkpoint (fp16, per-expert Mixtral layout, trained): engine vs transformers."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import torch
from engine_support import f16_matrices
from transformers import AutoModelForCausalLM

from moeswarm.demo import CHECKPOINT, DEFAULT_PROMPT
from moeswarm.model import SamplingParams, Tokenizer, generate, load_model


def test_demo_checkpoint_matches_transformers() -> None:
    model = load_model(CHECKPOINT)
    tokenizer = Tokenizer.from_folder(CHECKPOINT, model.config.bos_token_id)
    ids = tokenizer.encode(DEFAULT_PROMPT)
    ours = list(generate(model, ids, SamplingParams(max_new_tokens=24)))
    hf = AutoModelForCausalLM.from_pretrained(CHECKPOINT, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
        logits = hf(torch.tensor([ids + ours])).logits[0].numpy()
    assert ours == out[0, len(ids) :].tolist()
    mine = model.forward(np.asarray([ids + ours]), model.new_cache())[0]
    assert np.abs(mine - logits).max() <= 1e-3  # fp16 weights, fp32 math on both sides
    as_stored, copies = f16_matrices(model)  # computed from the fp16 bytes (``_f16``), no float32 copy kept
    assert copies == 0 and as_stored > 3, (as_stored, copies)


def test_cli_generates_readable_text_from_the_demo() -> None:
    r = subprocess.run([sys.executable, "-m", "moeswarm.cli", "generate", "--max-new-tokens", "16", "--print-token-ids"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith(DEFAULT_PROMPT) and "LORD" in lines[0]
    assert len(json.loads(lines[-1])) == 16
