"""``moeswarm plan``: a model's shapes at real scale from its config.json alone."""

from __future__ import annotations

import json

import click

from .._cli_util import friendly_errors

_FORMATS = ("BF16", "FP8", "MXFP4", "INT4", "Q8_0", "Q6_K", "Q5_K", "Q4_K", "IQ4_XS", "Q4_0", "Q3_K", "Q2_K")


def _b(n: float) -> str:
    """Parameters in B / M."""
    return f"{n / 1e9:,.1f}B" if n >= 1e9 else f"{n / 1e6:,.1f}M"


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


@click.command("plan")
@click.option("--model", "model", required=True, metavar="CONFIG_OR_DIR",
              help="A config.json, a model folder holding one (nothing else is read: no weights needed), or "
                   "the name of a config shipped with moeswarm: minimax-m3, deepseek-v3.2, kimi-k2.5, glm-4.5.")
@click.option("--format", "fmt", default=None, type=click.Choice(_FORMATS, case_sensitive=False),
              help="Stored format for the swarm and budget figures (default: what the config's "
                   "quantization_config says, else BF16).")
@click.option("--swarm", "nodes", default=0, type=click.IntRange(0), metavar="N",
              help="Split the routed experts over N expert nodes: experts and bytes per node.")
@click.option("--memory-budget", default=None, metavar="SIZE",
              help="Memory of one machine (e.g. 128GB, 64GiB): how many experts stay resident beside the "
                   "backbone, and how many such machines hold every expert.")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
@friendly_errors
def plan(model: str, fmt: str | None, nodes: int, memory_budget: str | None, as_json: bool) -> None:
    """Total and active parameters, bytes per expert in each stored format, the working set per
    token, and what a swarm or a memory budget implies, from config.json alone.

    Works for any MoE config.json that names its sizes the usual ways (hidden_size,
    num_hidden_layers, n_routed_experts / num_local_experts, num_experts_per_tok,
    moe_intermediate_size...), also for model types the engine does not run yet. Published
    configs ship with moeswarm: moeswarm/model/configs/.

    \b
    Examples:
      moeswarm plan --model minimax-m3
      moeswarm plan --model models/DeepSeek-V3.2 --swarm 32
      moeswarm plan --model kimi-k2.5 --memory-budget 128GB --format Q4_K
    """
    from pathlib import Path

    from .memory import parse_size
    from .plan import FORMATS, MODEL_CARDS, model_size, read_config, swarm_figures

    shipped = Path(__file__).parent / "configs" / f"{model}.json"
    card = None
    if not Path(model).exists() and shipped.is_file():
        card = MODEL_CARDS.get(model)
        model = str(shipped)
    elif not Path(model).exists():
        names = ", ".join(sorted(p.stem for p in shipped.parent.glob("*.json")))
        raise click.ClickException(f"{model}: no such file or folder, nor a shipped config ({names})")

    try:
        size = model_size(read_config(model))
    except KeyError as e:
        raise click.ClickException(f"{model}: config.json lacks {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise click.ClickException(f"{model}: config.json has a malformed field: {e}") from None
    chosen = (fmt or size.stored_format()).upper()
    budget = parse_size(memory_budget) if memory_budget else 0
    figures = swarm_figures(size, chosen, nodes=nodes, budget=budget)
    if as_json:
        click.echo(json.dumps({
            "model_type": size.model_type, "total_params": size.total, "active_params": size.active,
            "active_params_without_embeddings": size.active - size.embeddings, "layers": size.num_layers,
            "moe_layers": size.moe_layers, "experts_per_layer": size.num_experts, "top_k": size.top_k,
            "routed_experts": size.routed_experts, "active_experts_per_token": size.active_experts,
            "expert_params": size.expert_params, "stored_format": size.stored_format(), "format": chosen,
            "expert_bytes_by_format": {f: size.expert_bytes(f) for f in FORMATS}, **figures,
            **({"model_card": {"total": card.total, "active": card.active, "source": card.source}} if card else {})},
            indent=1))
        return
    ratio = size.total / size.active
    click.echo(f"{size.model_type}: {size.num_layers} layers ({size.num_layers - size.moe_layers} dense, "
               f"{size.moe_layers} MoE), {size.num_experts} experts per MoE layer, top-{size.top_k}")
    click.echo(f"  parameters      {_b(size.total)} total, {_b(size.active)} active per token "
               f"({_b(size.active - size.embeddings)} without embeddings and LM head); {ratio:.0f}:1")
    if card is not None:
        click.echo(f"  model card      {card.total} total, {card.active} active ({card.source})")
    click.echo(f"  routed experts  {size.routed_experts:,} in the model, {size.active_experts:,} active per token, "
               f"{_b(size.expert_params)} parameters each")
    click.echo(f"  stored as       {size.stored_format()}"
               + (f" ({size.quant.label})" if size.quant is not None
                  else f" (config.json: dtype {size.dtype}, no quantization_config)"))
    click.echo("  one expert      " + ", ".join(f"{f} {_gib(size.expert_bytes(f))}" for f in FORMATS))
    click.echo(f"in {chosen}:")
    click.echo(f"  all experts     {_gib(figures['experts_total_bytes'])}; backbone ~{_gib(figures['backbone_bytes'])}")
    click.echo(f"  working set     ~{_gib(figures['working_set_bytes'])} per token (backbone + "
               f"{size.active_experts} experts of {_gib(figures['expert_bytes'])})")
    if nodes:
        click.echo(f"  swarm of {nodes}     {figures['experts_per_node']:,} experts per node, "
                   f"{_gib(figures['bytes_per_node'])} each")
    if budget:
        resident = int(figures["resident_experts_one_machine"])
        click.echo(f"  budget {_gib(budget)}: one machine keeps {resident:,} of {size.routed_experts:,} experts "
                   f"({resident / size.routed_experts:.0%}) beside the backbone; "
                   f"{int(figures['machines_for_all_experts'])} such machines hold every expert")
