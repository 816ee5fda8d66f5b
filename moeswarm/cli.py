"""The ``moeswarm`` command line.  Each subcommand is a thin shell over a package's API."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

import click

from .errors import SwarmError

F = TypeVar("F", bound=Callable[..., Any])


def friendly_errors(fn: F) -> F:
    """Turn our own errors into one line on stderr and exit code 2 (no traceback)."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except SwarmError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)

    return wrapper  # type: ignore[return-value]


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="moeswarm")
def main() -> None:
    """moeswarm: serve Mixture-of-Experts language models from a swarm of volunteer machines."""


def _default_model() -> str:
    from .demo import CHECKPOINT

    return str(CHECKPOINT)


@main.command()
@click.option("--model", "model_dir", type=click.Path(), default=None,
              help="Hugging Face model folder (config.json + *.safetensors + tokenizer). Default: the shipped demo.")
@click.option("--prompt", default=None, help="Text to continue. Default: the demo prompt.")
@click.option("--prompt-ids", default=None, help="Token ids as a JSON list, instead of --prompt.")
@click.option("--max-new-tokens", default=64, show_default=True, type=click.IntRange(0, 1_000_000))
@click.option("--backend", default="auto", show_default=True,
              type=click.Choice(["auto", "eager", "grouped", "batched"]), help="How routed experts are computed.")
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0), help="0 means greedy.")
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0, 1, min_open=True))
@click.option("--seed", default=None, type=int, help="Seed for sampling (same seed, same text).")
@click.option("--print-token-ids", is_flag=True, help="Print the generated token ids as a JSON list on the last line.")
@friendly_errors
def generate(model_dir: str | None, prompt: str | None, prompt_ids: str | None, max_new_tokens: int, backend: str,
             temperature: float, top_p: float, seed: int | None, print_token_ids: bool) -> None:
    """Generate text from a checkpoint in this process, streaming it to stdout."""
    from .demo import DEFAULT_PROMPT
    from .errors import ConfigError
    from .model import SamplingParams, Tokenizer, load_model
    from .model import generate as run

    model_dir = model_dir or _default_model()
    model = load_model(model_dir, backend=backend)
    cfg = model.config
    tokenizer = None
    if prompt_ids is not None:
        try:
            ids = [int(i) for i in json.loads(prompt_ids)]
        except (ValueError, TypeError):
            raise ConfigError("--prompt-ids must be a JSON list of integers") from None
    else:
        tokenizer = Tokenizer.from_folder(model_dir, cfg.bos_token_id)
        ids = tokenizer.encode(prompt if prompt is not None else DEFAULT_PROMPT)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                            stop_token_ids=cfg.eos_token_ids)
    if tokenizer is None:
        try:
            tokenizer = Tokenizer.from_folder(model_dir, cfg.bos_token_id)
        except ConfigError:
            tokenizer = None  # ids in, ids out: text is optional
    stream = tokenizer.stream(ids) if tokenizer else None
    if tokenizer is not None and prompt_ids is None:
        click.echo(tokenizer.decode(ids), nl=False)  # the prompt, as the tokenizer reads it
    out: list[int] = []
    for token in run(model, ids, params):
        out.append(token)
        if stream is not None:
            click.echo(stream.feed(token), nl=False)
            sys.stdout.flush()
    click.echo()
    if print_token_ids:
        click.echo(json.dumps(out))


if __name__ == "__main__":  # pragma: no cover
    main()
