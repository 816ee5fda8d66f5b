"""``moeswarm convert-gguf``: a Hugging Face MoE checkpoint -> one GGUF file."""

from __future__ import annotations

from collections import Counter
from typing import Any

import click

from .._cli_util import friendly_errors

# Mirrors moeswarm.model._gguf_write.WEIGHT_TYPES (kept literal so --help does not import gguf).
_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0")


@click.command("convert-gguf")
@click.option("--model", "model_dir", required=True, type=click.Path(exists=True),
              help="Hugging Face model folder (config.json + *.safetensors), or a GGUF file to re-encode.")
@click.option("--out", required=True, type=click.Path(dir_okay=False),
              help="GGUF file to write, e.g. out/model.Q8_0.gguf (written to FILE.part, then renamed).")
@click.option("--type", "weight_type", default="F16", show_default=True,
              type=click.Choice(_TYPES, case_sensitive=False),
              help="Encoding of every 2-D weight (attention, embeddings, LM head, dense/shared MLPs, experts). "
                   "Norms, biases and routers always stay F32.")
@click.option("--experts-type", default=None, type=click.Choice(_TYPES, case_sensitive=False),
              help="Encoding of the routed experts only (default: --type).")
@click.option("--sidecar/--no-sidecar", default=True, show_default=True,
              help="Copy config.json and the tokenizer files beside the GGUF when absent there, so that its "
                   "folder works as --model for every command.")
@click.option("--split-max-size", default=None, metavar="SIZE",
              help="Split into files of at most SIZE of tensors each (e.g. 2G, 500M), named as llama.cpp's "
                   "gguf-split names them: OUT's stem + -00001-of-0000N.gguf. Any shard loads the whole model.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@friendly_errors
def convert_gguf(model_dir: str, out: str, weight_type: str, experts_type: str | None, sidecar: bool,
                 split_max_size: str | None, quiet: bool) -> None:
    """Convert a MoE checkpoint to GGUF with llama.cpp's tensor names.

    Experts are stacked per layer into blk.N.ffn_{gate,up,down}_exps and encoded expert by expert,
    so memory stays small whatever the model size.  The original config.json and tokenizer files
    are embedded, so the GGUF alone is enough to serve the model.

    \b
    Examples:
      moeswarm convert-gguf --model models/mixtral --out gguf/mixtral.f16.gguf
      moeswarm convert-gguf --model models/qwen3-moe --out gguf/qwen3.gguf --type F16 --experts-type Q8_0
      moeswarm convert-gguf --model models/mixtral --out gguf/mixtral.gguf --split-max-size 2G
      moeswarm generate --model gguf/qwen3.gguf --prompt "Hello"
    """
    from tqdm import tqdm

    from .gguf import convert_to_gguf
    from .memory import parse_size

    split = parse_size(split_max_size) if split_max_size else 0

    bars: list[Any] = []  # the bar appears once the plan (and so its total) is known

    def on_plan(plans: list[Any]) -> None:
        bars.append(tqdm(total=sum(p.nbytes for p in plans), unit="B", unit_scale=True, unit_divisor=1024,
                         desc=f"writing {out}", disable=quiet, dynamic_ncols=True))

    try:
        report = convert_to_gguf(model_dir, out, weight_type=weight_type.upper(),
                                 experts_type=experts_type.upper() if experts_type else None, sidecar=sidecar,
                                 on_tensor=lambda p: bars[0].update(p.nbytes), split_max_size=split, on_plan=on_plan)
    finally:
        for bar in bars:
            bar.close()
    counts = Counter(p.qtype.name for p in report.tensors)
    sizes: Counter[str] = Counter()
    for p in report.tensors:
        sizes[p.qtype.name] += p.nbytes
    click.echo(f"wrote {report.path} ({report.file_bytes / 2**20:.1f} MiB, {len(report.tensors)} tensors"
               + (f", in {len(report.shards)} files" if len(report.shards) > 1 else "") + ")")
    for name, n in counts.most_common():
        click.echo(f"  {name:5s} {n:5d} tensors  {sizes[name] / 2**20:10.1f} MiB")
    for qtype, size in report.bytes_per_expert().items():
        click.echo(f"  one routed expert: {size} bytes ({qtype})")
    for note in sorted({p.note for p in report.tensors if p.note}):
        n = sum(p.note == note for p in report.tensors)
        click.echo(f"  note: {n} tensor(s): {note}")
    if report.sidecars:
        click.echo(f"  beside it: {', '.join(report.sidecars)}")
