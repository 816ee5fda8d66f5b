#!/usr/bin/env python3
"""Train the tiny Mixtral-style demo checkpoint shipped in moeswarm/demo/checkpoint/.

The model is a small Mixture-of-Experts causal LM (transformers' MixtralForCausalLM:
8 experts, top-2 routing) trained for a few minutes on CPU on the King James Bible,
which is in the public domain. Its only purpose is to give moeswarm a real, small MoE
checkpoint that writes readable (KJV-flavoured) English, for demos and tests.

Data source
    Debian package ``bible-kjv-text`` (KJV text, public domain; the Debian copyright
    file notes the copyright on the 1611 translation has expired). It ships the text in
    a compressed form at /usr/lib/bible.data, which is read with the ``bible`` program
    from the Debian package ``bible-kjv``::

        apt-get install -y bible-kjv-text bible-kjv

    ``--text`` also accepts a plain-text file: either a dump in the same
    "Ge1:1 In the beginning ..." verse-per-line format (``bible -f Gen1:1-Rev22:21``)
    or any prose with paragraphs separated by blank lines.

Steps
    1. dump and clean the text: verse references are dropped and the verses of each
       chapter are joined into one prose paragraph (one training document per chapter);
    2. train a byte-level BPE tokenizer (``tokenizers``), specials <s>=0, </s>=1, <pad>=2;
    3. train MixtralForCausalLM with AdamW + warmup + cosine decay and the router
       load-balancing aux loss, for a fixed wall-clock budget (``--minutes``);
    4. save float16 weights with ``save_pretrained`` (per-expert hub layout), the
       tokenizer and a small tokenizer_config.json;
    5. reload the saved checkpoint in float32 and print greedy and sampled generations.

The defaults reproduce the shipped checkpoint (run from the repository root)::

    OPENBLAS_NUM_THREADS=1 python scripts/train_demo.py

Because training stops on wall-clock time, the exact number of steps (and therefore the
exact weights) depends on machine speed; pass ``--max-steps N`` for a step-exact run.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, MixtralConfig, MixtralForCausalLM

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TEXT = Path("/usr/lib/bible.data")
DEFAULT_OUT = REPO_ROOT / "moeswarm" / "demo" / "checkpoint"

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = [BOS, EOS, PAD]  # ids 0, 1, 2 (trainer assigns specials first)

VERSE_RE = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+)\s+(.*)$")
PROMPTS = ["And it came to pass", "And God said", "In the beginning", "The LORD is my shepherd"]


# --------------------------------------------------------------------------- data


def dump_bible_data(path: Path) -> str:
    """Decompress a bible-kjv data file (``bible.data``) to verse-per-line text."""
    exe = shutil.which("bible")
    if exe is None:
        sys.exit(
            f"error: {path} is a compressed bible-kjv data file; reading it needs the "
            "`bible` program from the Debian package bible-kjv:\n"
            "    apt-get install -y bible-kjv"
        )
    cmd = [exe, "-f", "-p", str(path.parent), "-d", path.name, "Gen1:1-Rev22:21"]
    res = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=True)
    return res.stdout


def load_documents(path: Path) -> list[str]:
    """Return a list of prose documents (one per Bible chapter)."""
    if not path.exists():
        sys.exit(
            f"error: text not found at {path}.\n"
            "The default source is the King James Bible (public domain) from Debian:\n"
            "    apt-get install -y bible-kjv-text bible-kjv\n"
            "or pass --text PATH to a plain-text file."
        )
    with open(path, "rb") as f:
        magic = f.read(4)
    raw = dump_bible_data(path) if magic == b"EC02" else path.read_text(encoding="utf-8")

    lines = [ln.strip() for ln in raw.splitlines()]
    if lines and VERSE_RE.match(next(ln for ln in lines if ln)):
        # "Ge1:1 In the beginning ..." -> join verses of each chapter into a paragraph.
        chapters: dict[tuple[str, str], list[str]] = {}
        for ln in lines:
            m = VERSE_RE.match(ln)
            if m:
                book, chap, _verse, text = m.groups()
                chapters.setdefault((book, chap), []).append(text)
        docs = [" ".join(verses) for verses in chapters.values()]
    else:
        # Plain prose: paragraphs separated by blank lines.
        docs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", raw)]
    docs = [re.sub(r"\s+", " ", d).strip() for d in docs]
    return [d for d in docs if d]


# ---------------------------------------------------------------------- tokenizer


def train_tokenizer(docs: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    # encode("...") prepends <s> (Llama-style); use add_special_tokens=False to skip it.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    return tok


def encode_docs(tok: Tokenizer, docs: list[str]) -> np.ndarray:
    """Concatenate documents as <s> doc </s> <s> doc </s> ... into one token stream."""
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    out: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        out.append(bos)
        out.extend(enc.ids)
        out.append(eos)
    return np.asarray(out, dtype=np.int64)


# -------------------------------------------------------------------------- model


def build_config(args: argparse.Namespace, vocab_size: int) -> MixtralConfig:
    return MixtralConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        output_router_logits=True,
        router_aux_loss_coef=args.aux_coef,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        attn_implementation="eager",
    )


def lr_at(step: int, frac_done: float, args: argparse.Namespace) -> float:
    """Linear warmup (in steps), then cosine decay to min_lr over the run's progress."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    frac = min(max(frac_done, 0.0), 1.0)
    min_lr = args.lr * args.min_lr_ratio
    return min_lr + 0.5 * (args.lr - min_lr) * (1.0 + math.cos(math.pi * frac))


@torch.no_grad()
def evaluate(model: MixtralForCausalLM, val: np.ndarray, seq_len: int, batch_size: int, max_batches: int) -> float:
    """Mean next-token cross-entropy (nats) on consecutive windows of the held-out stream."""
    model.eval()
    n_win = min((len(val) - 1) // seq_len, max_batches * batch_size)
    windows = torch.from_numpy(val[: n_win * seq_len].reshape(n_win, seq_len))
    losses = []
    for i in range(0, n_win, batch_size):
        x = windows[i : i + batch_size]
        logits = model(input_ids=x, output_router_logits=False).logits
        losses.append(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten()).item())
    model.train()
    return float(np.mean(losses))


def generate_samples(model, tok: Tokenizer, seed: int, max_new_tokens: int = 48) -> dict[str, list[str]]:
    model.eval()
    out: dict[str, list[str]] = {}
    for prompt in PROMPTS:
        ids = torch.tensor([tok.encode(prompt).ids])  # <s> + prompt
        greedy = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        torch.manual_seed(seed)
        sampled = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=True, temperature=0.8, top_k=40)
        out[prompt] = [tok.decode(g.tolist(), skip_special_tokens=True) for g in (greedy[0], sampled[0])]
    return out


# ------------------------------------------------------------ multi-token prediction


def mtp_loss(model, mtp, x: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the MTP layer's guess of token j + 2 from the frozen model's final-normed
    hidden state at j and the embedding of token j + 1 (slot j sits at position j + 1)."""
    with torch.no_grad():
        hidden = model(input_ids=x, output_hidden_states=True, output_router_logits=False).hidden_states[-1]
    positions = torch.arange(1, x.shape[1], device=x.device)[None].expand(x.shape[0], -1)
    g = mtp.forward_layer(0, hidden[:, :-1], positions, None, input_ids=x[:, 1:])
    logits = mtp._project_to_logits(g[:, :-1])  # slot j predicts x[:, j + 2]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x[:, 2:].flatten())


def train_mtp(args: argparse.Namespace) -> None:
    """Train one multi-token-prediction layer beside the checkpoint in ``args.out`` (the model frozen,
    its weights untouched) and store it as DeepSeek-V3 does: ``model.layers.{n}.*`` (a decoder layer of
    the model's own kind, its experts in the same per-expert layout) plus ``enorm``, ``hnorm``,
    ``eh_proj`` and ``shared_head.norm``; moeswarm finds it from those keys (config.json is unchanged,
    so the model id is too; transformers' MixtralForCausalLM ignores the extra keys)."""
    from safetensors.torch import load_file, save_file
    from transformers.modeling_layers import MtpModel

    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed + 1)
    tok = Tokenizer.from_file(str(args.out / "tokenizer.json"))
    docs = load_documents(args.text)
    train_docs = [d for i, d in enumerate(docs) if (i + 1) % args.val_every != 0]
    val_ids = encode_docs(tok, docs[args.val_every - 1 :: args.val_every])
    train_ids = encode_docs(tok, train_docs)
    model = MixtralForCausalLM.from_pretrained(args.out, dtype=torch.float32, attn_implementation="eager").eval()
    for p in model.parameters():
        p.requires_grad_(False)
    n = model.config.num_hidden_layers
    model.config.num_mtp_layers = 1
    mtp = MtpModel(model, 1)
    layer = mtp.layers[0]
    layer.mtp_block.load_state_dict(model.model.layers[-1].state_dict())  # start from the last layer
    with torch.no_grad():
        H = model.config.hidden_size
        layer.eh_proj.weight.copy_(torch.cat([0.02 * torch.randn(H, H), torch.eye(H)], dim=1))
    params = [p for p in layer.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=args.mtp_lr, betas=(0.9, 0.95), weight_decay=0.0)
    T, B, budget = args.seq_len, args.batch_size, args.mtp_minutes * 60.0
    hi, step, t_start, ema = len(train_ids) - T - 1, 0, time.time(), None
    mtp.train()
    print(f"MTP layer: {sum(p.numel() for p in params) / 1e6:.2f}M params, {args.mtp_minutes:g} min")
    while time.time() - t_start < budget:
        frac = (time.time() - t_start) / budget
        for g in opt.param_groups:
            g["lr"] = args.mtp_lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))
        starts = rng.integers(0, hi, size=B)
        loss = mtp_loss(model, mtp, torch.from_numpy(np.stack([train_ids[s : s + T] for s in starts])))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % args.log_every == 0 or step == 1:
            print(f"mtp step {step:5d} | {(time.time() - t_start) / 60:5.1f} min | loss {loss.item():.3f} "
                  f"(ema {ema:.3f})", flush=True)
    mtp.eval()
    with torch.no_grad():
        windows = torch.from_numpy(val_ids[: (len(val_ids) // T) * T].reshape(-1, T))[: 4 * B]
        val = float(np.mean([mtp_loss(model, mtp, windows[i : i + B]).item() for i in range(0, len(windows), B)]))
    print(f"MTP done: {step} steps, train loss (ema) {ema:.3f}, val loss {val:.3f} (token j + 2)")

    # the layer in the model's own stored format: a model one layer longer, saved, its last layer's keys
    bigger = copy.deepcopy(model.config)
    bigger.num_hidden_layers = n + 1
    longer = MixtralForCausalLM(bigger).to(torch.float16)
    longer.model.layers[n].load_state_dict(layer.mtp_block.state_dict())
    with tempfile.TemporaryDirectory() as tmp:
        longer.save_pretrained(tmp)
        saved = load_file(str(Path(tmp) / "model.safetensors"))
    path = args.out / "model.safetensors"
    tensors = {k: v for k, v in load_file(str(path)).items() if not k.startswith(f"model.layers.{n}.")}
    tensors.update({k: v for k, v in saved.items() if k.startswith(f"model.layers.{n}.")})
    for name, stored in (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"), ("post_norm", "shared_head.norm")):
        tensors[f"model.layers.{n}.{stored}.weight"] = getattr(layer, name).weight.detach().to(torch.float16)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
    log_path = args.out / "train_log.json"
    log = json.loads(log_path.read_text()) if log_path.exists() else {}
    log["mtp"] = {"steps": step, "train_minutes": round((time.time() - t_start) / 60, 2),
                  "final_train_loss_ema": round(ema, 4), "val_loss": round(val, 4), "lr": args.mtp_lr,
                  "params": sum(p.numel() for p in params)}
    log_path.write_text(json.dumps(log, indent=2) + "\n")
    print(f"stored the MTP layer as model.layers.{n}.* in {path} ({path.stat().st_size / 1e6:.2f} MB)")


# --------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="bible-kjv data file or plain-text file")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output checkpoint folder")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--hidden-size", type=int, default=144)
    p.add_argument("--intermediate-size", type=int, default=256, help="FFN size of each expert")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--aux-coef", type=float, default=0.01, help="router load-balancing loss coefficient")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.05)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--minutes", type=float, default=10.0, help="wall-clock training budget")
    p.add_argument("--max-steps", type=int, default=None, help="stop after N steps (schedule follows steps, not time)")
    p.add_argument("--val-every", type=int, default=100, help="hold out every N-th chapter for validation")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mtp-minutes", type=float, default=6.0,
                   help="then train a multi-token-prediction layer (the model frozen) for this long; 0: none")
    p.add_argument("--mtp-lr", type=float, default=2e-3)
    p.add_argument("--mtp-only", action="store_true",
                   help="only train the MTP layer of the checkpoint already in --out (its other weights untouched)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.mtp_only:
        train_mtp(args)
        return
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)

    # 1. data ---------------------------------------------------------------
    docs = load_documents(args.text)
    val_docs = docs[args.val_every - 1 :: args.val_every]
    train_docs = [d for i, d in enumerate(docs) if (i + 1) % args.val_every != 0]
    print(f"text: {args.text}: {len(docs)} documents, {sum(map(len, docs)) / 1e6:.2f}M chars "
          f"({len(train_docs)} train / {len(val_docs)} val)")
    print(f"  sample: {docs[0][:150]}...")

    # 2. tokenizer ----------------------------------------------------------
    t0 = time.time()
    tok = train_tokenizer(docs, args.vocab_size)
    train_ids, val_ids = encode_docs(tok, train_docs), encode_docs(tok, val_docs)
    print(f"tokenizer: vocab {tok.get_vocab_size()}, {len(train_ids) / 1e6:.2f}M train tokens, "
          f"{len(val_ids) / 1e3:.0f}k val tokens, {sum(map(len, train_docs)) / len(train_ids):.2f} chars/token "
          f"({time.time() - t0:.0f}s)")

    # 3. model + training ---------------------------------------------------
    config = build_config(args, tok.get_vocab_size())
    model = MixtralForCausalLM(config)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    n_expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    n_active = n_params - n_expert + n_expert * args.top_k // args.experts
    print(f"model: {n_params / 1e6:.2f}M params ({n_expert / 1e6:.2f}M in experts, "
          f"~{n_active / 1e6:.2f}M active per token)")

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed_tokens" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed_tokens" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95),
    )

    budget = args.minutes * 60.0
    T, B = args.seq_len, args.batch_size
    hi = len(train_ids) - T - 1
    step, ema, t_start = 0, None, time.time()
    print(f"training: batch {B}x{T} tokens, lr {args.lr}, budget "
          + (f"{args.max_steps} steps" if args.max_steps else f"{args.minutes:g} min"))
    while True:
        elapsed = time.time() - t_start
        if args.max_steps is not None:
            if step >= args.max_steps:
                break
            frac = step / args.max_steps
        else:
            if elapsed >= budget:
                break
            frac = elapsed / budget
        lr = lr_at(step, frac, args)
        for g in opt.param_groups:
            g["lr"] = lr

        starts = rng.integers(0, hi, size=B)
        x = torch.from_numpy(np.stack([train_ids[s : s + T] for s in starts]))
        out = model(input_ids=x, labels=x)  # loss = LM loss + aux_coef * load-balancing loss
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1

        lm_loss = (out.loss - args.aux_coef * out.aux_loss).item()
        ema = lm_loss if ema is None else 0.95 * ema + 0.05 * lm_loss
        if step % args.log_every == 0 or step == 1:
            el = time.time() - t_start
            print(f"step {step:5d} | {el / 60:5.1f} min | lr {lr:.2e} | loss {lm_loss:.3f} (ema {ema:.3f}) "
                  f"| aux {out.aux_loss.item():.3f} | {step * B * T / el:.0f} tok/s", flush=True)
        if step % 500 == 0:
            print(f"  val loss {evaluate(model, val_ids, T, B, max_batches=4):.3f}", flush=True)

    train_min = (time.time() - t_start) / 60
    val_loss = evaluate(model, val_ids, T, B, max_batches=16)
    print(f"done: {step} steps in {train_min:.1f} min, final train loss (ema) {ema:.3f}, val loss {val_loss:.3f}")

    # 4. save (float16, per-expert hub layout) ------------------------------
    fp32_samples = generate_samples(model, tok, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    model.eval()
    model = model.to(torch.float16)
    model.config.dtype = torch.float16
    model.config.output_router_logits = False  # inference default; turn on again to fine-tune
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=2)
    model.save_pretrained(args.out)
    tok.save(str(args.out / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "model_max_length": config.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
    }
    (args.out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    (args.out / "train_log.json").write_text(json.dumps({
        "steps": step, "train_minutes": round(train_min, 2), "final_train_loss_ema": round(ema, 4),
        "val_loss": round(val_loss, 4), "params": n_params, "tokens_seen": step * B * T,
        "train_tokens": int(len(train_ids)), "args": {k: str(v) for k, v in vars(args).items()},
    }, indent=2) + "\n")
    sizes = {p.name: p.stat().st_size for p in sorted(args.out.iterdir()) if p.is_file()}
    print(f"saved to {args.out}: " + ", ".join(f"{k} {v / 1e3:.0f} kB" for k, v in sizes.items())
          + f" (total {sum(sizes.values()) / 1e6:.2f} MB)")

    # 5. reload in float32 and sample ---------------------------------------
    reloaded = MixtralForCausalLM.from_pretrained(args.out, dtype=torch.float32, attn_implementation="eager")
    tok2 = Tokenizer.from_file(str(args.out / "tokenizer.json"))
    samples = generate_samples(reloaded, tok2, args.seed)
    for prompt, (greedy, sampled) in samples.items():
        same = "same as before saving" if fp32_samples[prompt][0] == greedy else "differs from fp32 pre-save"
        print(f"\n[{prompt!r}]\n  greedy ({same}): {greedy}\n  sampled: {sampled}")
    if args.mtp_minutes > 0:
        train_mtp(args)


if __name__ == "__main__":
    main()
