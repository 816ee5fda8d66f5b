"""The ``moeswarm`` command line.  Each subcommand is a thin shell over a package's API."""

from __future__ import annotations

import json

import click

from ._cli_util import DEFAULT_MTP_DRAFT, echo_prompt, friendly_errors, served_summary, stream


class LazyGroup(click.Group):
    """Subcommands that live in other packages are imported only when used: ``moeswarm generate``
    should not pay for aiohttp, onnxruntime or the ledger's SQLAlchemy (time and resident memory)."""

    lazy = {
        "node": "moeswarm.node.cli:node",
        "backbone": "moeswarm.node.cli:backbone",
        "relay": "moeswarm.relay.cli:relay",
        "bridge": "moeswarm.mobile_bridge.cli:bridge",
        "export-onnx": "moeswarm.mobile_bridge.cli:export_onnx",
        "market": "moeswarm.market_cli:market",
        "convert-gguf": "moeswarm.model.gguf_cli:convert_gguf",
        "expert-digests": "moeswarm.node.cli:expert_digests",
        "monitor": "moeswarm.monitor.cli:monitor",
        "models": "moeswarm.monitor.cli:models",
        "plan": "moeswarm.model.plan_cli:plan",
        "complete": "moeswarm.sdk.cli:complete",
        "chat": "moeswarm.sdk.cli:chat",
    }

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *self.lazy])

    def resolve_command(self, ctx: click.Context, args: list[str]) -> tuple[str | None, click.Command | None, list[str]]:
        # ``moeswarm node status``: a command of its own (``node`` itself takes a required --model)
        if args[:2] == ["node", "status"]:
            from .node.cli import node_status

            return "node status", node_status, args[2:]
        return super().resolve_command(ctx, args)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.lazy:
            import importlib

            module, _, attr = self.lazy[name].partition(":")
            return getattr(importlib.import_module(module), attr)  # type: ignore[no-any-return]
        return super().get_command(ctx, name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="moeswarm")
def main() -> None:
    """moeswarm: serve Mixture-of-Experts language models from a swarm of volunteer machines."""


def _default_model() -> str:
    from .demo import CHECKPOINT

    return str(CHECKPOINT)


@main.command()
@click.option("--model", "model_dir", type=click.Path(), default=None,
              help="Hugging Face model folder (config.json + *.safetensors + tokenizer) or GGUF file. "
                   "Vision-language checkpoints (MiniMax M3, Kimi K2.5, Qwen3.5-MoE, Mistral Large 4) serve their "
                   "language model: images are not supported yet. Default: the shipped demo.")
@click.option("--prompt", default=None, help="Text to continue. Default: the demo prompt.")
@click.option("--prompt-ids", default=None, help="Token ids as a JSON list, instead of --prompt.")
@click.option("--max-new-tokens", default=64, show_default=True, type=click.IntRange(0, 1_000_000))
@click.option("--backend", default="auto", show_default=True,
              type=click.Choice(["auto", "eager", "grouped", "batched"]), help="How routed experts are computed.")
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0), help="0 means greedy.")
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0, 1, min_open=True),
              help="Sample from the smallest set of tokens whose probability reaches P.")
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(0),
              help="Sample from the K most likely tokens only (0 = all).")
@click.option("--seed", default=None, type=int, help="Seed for sampling (same seed, same text).")
@click.option("--print-token-ids", is_flag=True, help="Print the generated token ids as a JSON list on the last line.")
@click.option("--swarm", multiple=True, metavar="MULTIADDR",
              help="Compute the routed experts in the swarm reached through this bootstrap peer (repeatable); "
                   "this process runs the backbone and reads no expert weights.")
@click.option("--local-fallback", is_flag=True, help="With --swarm: compute experts nobody serves locally.")
@click.option("--relay-ca", default=None, type=click.Path(exists=True, dir_okay=False),
              help="With --swarm: trust this CA for relays of NAT'd devices (default: the system store).")
@click.option("--show-experts", is_flag=True, help="With --swarm: print which peer served which experts (stderr).")
@click.option("--ledger", "ledger_url", default=None, metavar="URL",
              help="With --swarm: submit the countersigned receipts of the experts served to this ledger.")
@click.option("--audit-fraction", default=0.0, show_default=True, type=click.FloatRange(0, 1), metavar="F",
              help="With --swarm and --ledger: have the ledger re-execute this share of expert calls.")
@click.option("--identity", "identity_file", default=None, type=click.Path(dir_okay=False),
              help="With --swarm: your key file (created if missing); the receipts of the expert calls are "
                   "countersigned with it, so with --ledger they are paid from its account. Default: a new "
                   "key each run (whose receipts a ledger refuses as unfunded).")
@click.option("--speculative", default=0, type=click.IntRange(0, 32), metavar="K",
              help="Greedy only: verify up to K prompt-lookup draft tokens per forward pass (same output, "
                   "fewer round trips through the swarm). 0 = off.")
@click.option("--draft", default="lookup", show_default=True, type=click.Choice(["lookup", "mtp"]),
              help="What proposes the speculative drafts: prompt lookup (--speculative K, greedy only), or mtp: "
                   "the checkpoint's own multi-token-prediction layer, at any temperature (exact speculative "
                   f"sampling); --draft mtp without --speculative drafts {DEFAULT_MTP_DRAFT} tokens per step.")
@click.option("--memory-budget", default=None, metavar="SIZE",
              help="Keep this process's resident memory under SIZE (e.g. 8GB) by paging experts in and out "
                   "of the memory-mapped checkpoint.")
@click.option("--stats", is_flag=True, help="Print memory, page-fault, disk-read and speed figures (stderr).")
@click.option("--coverage-timeout", default=60.0, show_default=True, type=click.FloatRange(min=0), metavar="SECONDS",
              help="With --swarm: wait this long for every expert to be announced (then fail, or with "
                   "--local-fallback compute the missing ones here).")
@friendly_errors
def generate(model_dir: str | None, prompt: str | None, prompt_ids: str | None, max_new_tokens: int, backend: str,
             temperature: float, top_p: float, top_k: int, seed: int | None, print_token_ids: bool,
             swarm: tuple[str, ...], local_fallback: bool, relay_ca: str | None, show_experts: bool, ledger_url: str | None,
             audit_fraction: float, identity_file: str | None, speculative: int, draft: str,
             memory_budget: str | None, stats: bool, coverage_timeout: float) -> None:
    """Generate text from a checkpoint, streaming it to stdout: in this process, or with --swarm."""
    from .model import load_model

    model_dir = model_dir or _default_model()
    if identity_file is not None and not swarm:
        from .errors import ConfigError

        raise ConfigError("--identity countersigns the swarm's receipts: it needs --swarm")
    if draft == "mtp" and not speculative:
        speculative = DEFAULT_MTP_DRAFT
    if swarm:
        import asyncio

        from .daemon import SwarmConfig
        from .node.backbone import SwarmBackbone
        from .node.config import BackboneConfig
        from .node.scheduler import EngineConfig

        if relay_ca is not None:
            from .relay import set_relay_ca

            set_relay_ca(relay_ca)

        config = BackboneConfig(SwarmConfig(model_dir, bootstrap=swarm, client_mode=True, identity_file=identity_file),
                                local_fallback=local_fallback, ledger_url=ledger_url, audit_fraction=audit_fraction,
                                coverage_timeout_s=coverage_timeout, draft=draft,
                                engine=EngineConfig(speculative=speculative if draft == "mtp" else 0))

        async def in_swarm() -> None:
            async with SwarmBackbone(config) as backbone:
                assert backbone.model is not None and backbone.executor is not None
                await asyncio.to_thread(_generate_with, backbone.model, model_dir, prompt, prompt_ids,
                                        max_new_tokens, temperature, top_p, seed, print_token_ids, speculative,
                                        top_k, draft)
                if show_experts:
                    _print_placement(backbone.executor.served_by)

        asyncio.run(in_swarm())
        return
    import time

    from .model.memory import MemoryBudget, MemoryStats, parse_size

    start = MemoryStats.now()
    model = load_model(model_dir, backend=backend)
    budget = None
    if memory_budget is not None:
        from .model import LocalExperts
        from .model.experts import F32Cache

        budget = MemoryBudget(model.weights, parse_size(memory_budget))
        budget.attach(model)
        if isinstance(model.experts, LocalExperts):  # fp32 copies of fp16 experts count against the budget
            model.experts.cache = F32Cache(budget.budget // 8)
    t0 = time.perf_counter()
    n = _generate_with(model, model_dir, prompt, prompt_ids, max_new_tokens, temperature, top_p, seed,
                       print_token_ids, speculative, top_k, draft)
    if stats:
        from .model.memory import footprint

        click.echo(footprint(model), err=True)
        click.echo(MemoryStats.now().report(start, n, time.perf_counter() - t0)
                   + (f"; {budget.evictions} expert evictions, expert cache hit rate {budget.stats.hit_rate:.0%}, "
                      f"{budget.stats.bytes_fetched / 2**20:.0f} MiB fetched, next-layer prediction accuracy "
                      f"{budget.stats.prefetch_accuracy:.0%}" if budget else ""), err=True)


def _print_placement(served_by: dict[bytes, set[tuple[int, int]]]) -> None:
    from .protocol import peer_id_to_str

    click.echo("experts served, by peer:", err=True)
    for peer, pairs in sorted(served_by.items()):
        click.echo(f"  {peer_id_to_str(peer)[-12:]}  {served_summary(pairs)}", err=True)


def _generate_with(model, model_dir: str, prompt: str | None, prompt_ids: str | None,  # type: ignore[no-untyped-def]
                   max_new_tokens: int, temperature: float, top_p: float, seed: int | None,
                   print_token_ids: bool, speculative: int = 0, top_k: int = 0, draft: str = "lookup") -> int:
    from .demo import DEFAULT_PROMPT
    from .errors import ConfigError
    from .model import SamplingParams, Tokenizer
    from .model import generate as run
    from .model.speculative import MtpDraft, SpeculativeStats, generate_drafted, generate_speculative

    cfg = model.config
    tokenizer = None
    if prompt_ids is not None:
        try:
            ids = [int(i) for i in json.loads(prompt_ids)]
        except (ValueError, TypeError):
            raise ConfigError("--prompt-ids must be a JSON list of integers") from None
    else:
        tokenizer = Tokenizer.from_folder(model.weights.folder, cfg.bos_token_id)
        ids = tokenizer.encode(prompt if prompt is not None else DEFAULT_PROMPT)
    if speculative and temperature != 0 and draft != "mtp":  # before the prompt is printed: its own line
        raise ConfigError("--speculative needs --temperature 0 (greedy)")
    drafter = MtpDraft(model) if draft == "mtp" else None
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            seed=seed, stop_token_ids=cfg.eos_token_ids)
    if tokenizer is None:
        try:
            tokenizer = Tokenizer.from_folder(model.weights.folder, cfg.bos_token_id)
        except ConfigError:
            tokenizer = None  # ids in, ids out: text is optional
    text = tokenizer.stream(ids) if tokenizer else None
    if tokenizer is not None and prompt_ids is None:
        echo_prompt(tokenizer.decode(ids))  # the prompt, as the tokenizer reads it
    drafts = SpeculativeStats()
    tokens = (generate_drafted(model, ids, params, drafter, k=speculative, stats=drafts) if drafter is not None
              else generate_speculative(model, ids, params, k=speculative, stats=drafts) if speculative
              else run(model, ids, params))
    out = stream(tokens, text.feed if text is not None else None)
    if speculative:
        click.echo(f"speculative: {drafts.accepted} of {drafts.drafted} draft tokens accepted "
                   f"({drafts.accepted / max(drafts.drafted, 1):.0%}), {len(out)} tokens in "
                   f"{drafts.steps + 1} forward passes", err=True)
    if print_token_ids:
        click.echo(json.dumps(out))
    return len(out)


@main.command()
@click.option("--model", "model_dir", type=click.Path(), default=None, help="Model folder. Default: the shipped demo.")
@click.option("--prompt", default=None, help="Text to continue. Default: the demo prompt.")
@click.option("--nodes", default=3, show_default=True, type=click.IntRange(1, 64), help="Expert node processes.")
@click.option("--max-new-tokens", default=48, show_default=True, type=click.IntRange(0, 100_000))
@click.option("--monitor", "monitor", is_flag=False, flag_value="127.0.0.1:8700", default=None, metavar="[HOST:PORT]",
              help="Also run the swarm map (`moeswarm monitor`) beside the demo (default address 127.0.0.1:8700).")
@click.option("--keep", default=0.0, type=click.FloatRange(0, 24 * 3600), metavar="SECONDS",
              help="Keep the swarm (and the map) up this long after generating, to look at it.")
@click.option("--export", "export_dir", type=click.Path(file_okay=False), default=None, metavar="DIR",
              help="Copy the shipped demo checkpoint to DIR (new or empty) and exit, to use it as --model DIR.")
@friendly_errors
def demo(model_dir: str | None, prompt: str | None, nodes: int, max_new_tokens: int, monitor: str | None,
         keep: float, export_dir: str | None) -> None:
    """Start a local swarm on loopback, generate through it, show who served what, stop it."""
    if export_dir is not None:
        from .demo.export import export_checkpoint

        click.echo(f"demo checkpoint copied to {export_checkpoint(export_dir)}")
        return
    from .demo import DEFAULT_PROMPT
    from .demo.swarm import run_demo

    run_demo(model_dir or _default_model(), prompt or DEFAULT_PROMPT, nodes, max_new_tokens, monitor, keep)


if __name__ == "__main__":  # pragma: no cover
    main()
