"""``moeswarm complete`` and ``moeswarm chat``: use the swarm through its gateways, no backbone here."""

from __future__ import annotations

import json
from typing import Any

import click

from .._cli_util import friendly_errors


def client_options(fn):  # type: ignore[no-untyped-def]
    options = [
        click.option("--swarm", "swarm", multiple=True, required=True, metavar="MULTIADDR",
                     help="A peer of the swarm to join through (repeatable), e.g. /ip4/1.2.3.4/tcp/4001/p2p/12D3Koo..."),
        click.option("--model", "model", required=True,
                     help="The model: a checkpoint folder, its config.json, or a model id from the swarm's "
                          "catalogue (`moeswarm models`); no weights are needed."),
        click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0, 2), help="0 means greedy."),
        click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0, 1, min_open=True)),
        click.option("--top-k", default=0, show_default=True, type=click.IntRange(0)),
        click.option("--seed", default=None, type=int, help="Seed for sampling."),
        click.option("--identity", "identity_file", default=None, type=click.Path(dir_okay=False),
                     help="Your key file: sign spending authorizations with it to pay priced gateways."),
        click.option("--max-credits", default=None, type=click.IntRange(min=1), metavar="N",
                     help="With --identity: authorize each gateway to charge at most N credits (default: "
                          "max-new-tokens x its announced price)."),
        click.option("--authorization-ttl", default=3600.0, show_default=True, type=click.FloatRange(min=1),
                     metavar="SECONDS", help="With --identity: authorizations expire this long after signing."),
        click.option("--discovery-timeout", default=15.0, show_default=True, type=click.FloatRange(min=0),
                     metavar="SECONDS", help="Wait this long for a gateway of the model to be announced."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _client(swarm: tuple[str, ...], model: str, identity_file: str | None, max_credits: int | None,
            ttl_s: float, wait_s: float, max_new_tokens: int) -> Any:
    from .gateway import GatewayClient, find_gateways, model_id_of

    model_id = model_id_of(model)
    gateways = find_gateways(swarm, model_id, wait_s=wait_s)
    authorize = None
    if identity_file is not None:
        from .spending import Authorizer

        authorize = Authorizer.from_file(identity_file, model_id, max_credits=max_credits, ttl_s=ttl_s,
                                         default_tokens=max_new_tokens)

    def say(record: Any) -> None:
        click.echo(f"gateway {record.peer} {record.url}", err=True)

    return GatewayClient(gateways, model=model_id, on_choice=say,
                         **({"authorize": authorize.headers} if authorize is not None else {})), authorize


@click.command()
@client_options
@click.option("--prompt", default=None, help="Text to continue.")
@click.option("--prompt-ids", default=None, help="Token ids as a JSON list, instead of --prompt.")
@click.option("--max-new-tokens", default=64, show_default=True, type=click.IntRange(0, 1_000_000))
@click.option("--print-token-ids", is_flag=True, help="Print the generated token ids as a JSON list on the last line.")
@friendly_errors
def complete(swarm: tuple[str, ...], model: str, temperature: float, top_p: float, top_k: int, seed: int | None,
             identity_file: str | None, max_credits: int | None, authorization_ttl: float, discovery_timeout: float,
             prompt: str | None, prompt_ids: str | None, max_new_tokens: int, print_token_ids: bool) -> None:
    """Continue a prompt through the swarm's gateways, streaming to stdout; no model weights needed.

    Finds the gateways serving the model, picks the one with the least measured latency and a free
    place in its batch, and on its death resumes the same generation on the next (greedy output is
    unchanged). Says on stderr `gateway PEER_ID URL` for every choice or switch. Example:

    \b
      moeswarm complete --swarm /ip4/203.0.113.5/tcp/4001/p2p/12D3KooW... \\
          --model mixtral-76b2c92d8168 --prompt "And it came to pass" --max-new-tokens 32
    """
    from ..errors import ConfigError
    from .gateway import Generation

    if (prompt is None) == (prompt_ids is None):
        raise ConfigError("give --prompt or --prompt-ids")
    ids: Any = prompt
    if prompt_ids is not None:
        try:
            ids = [int(i) for i in json.loads(prompt_ids)]
        except (ValueError, TypeError):
            raise ConfigError("--prompt-ids must be a JSON list of integers") from None
    client, authorizer = _client(swarm, model, identity_file, max_credits, authorization_ttl, discovery_timeout,
                                 max_new_tokens)
    result = Generation([], [], "", [], None)
    try:
        for piece, new_ids in client.stream(ids, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                            top_k=top_k, seed=seed, result=result):
            click.echo(piece, nl=False)
            if authorizer is not None:
                authorizer.received(len(new_ids))
    finally:
        if authorizer is not None:
            authorizer.close()
    click.echo()
    if print_token_ids:
        click.echo(json.dumps(result.token_ids))


@click.command()
@client_options
@click.option("--max-new-tokens", default=256, show_default=True, type=click.IntRange(1, 1_000_000))
@friendly_errors
def chat(swarm: tuple[str, ...], model: str, temperature: float, top_p: float, top_k: int, seed: int | None,
         identity_file: str | None, max_credits: int | None, authorization_ttl: float, discovery_timeout: float,
         max_new_tokens: int) -> None:
    """Chat with a model through the swarm's gateways: one message per line on stdin, replies streamed.

    Ctrl-D ends the conversation. Says on stderr `gateway PEER_ID URL` for every choice or switch.
    """
    from .gateway import Generation

    client, authorizer = _client(swarm, model, identity_file, max_credits, authorization_ttl, discovery_timeout,
                                 max_new_tokens)
    messages: list[dict[str, str]] = []
    try:
        while True:
            line = click.get_text_stream("stdin").readline()
            if not line:
                break
            messages.append({"role": "user", "content": line.rstrip("\n")})
            result = Generation([], [], "", [], None)
            for piece, ids in client.stream(messages=messages, max_new_tokens=max_new_tokens, temperature=temperature,
                                            top_p=top_p, top_k=top_k, seed=seed, result=result):
                click.echo(piece, nl=False)
                if authorizer is not None:
                    authorizer.received(len(ids))
            click.echo()
            messages.append({"role": "assistant", "content": result.text})
    finally:
        if authorizer is not None:
            authorizer.close()
