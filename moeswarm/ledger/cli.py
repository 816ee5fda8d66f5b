"""``moeswarm-ledger``: inspect, verify, settle and serve a receipt ledger.

Every command takes ``--db``: a file path (SQLite) or any SQLAlchemy URL
(``postgresql://user@host/dbname``). Errors are one line on stderr with exit code 2 (a missing
database, a bad URL, a missing key ...); ``verify``, ``check-proof``, ``prove --bootstrap`` and
``root`` exit 1 when what they check is wrong (or, for ``root``, absent). ``--bootstrap`` reaches
the swarm's DHT, where ``settle`` publishes each epoch's signed root.
"""

from __future__ import annotations

import asyncio
import csv
import json
import sys
from datetime import datetime, timezone
from typing import Any

import click

from moeswarm._cli_util import friendly_errors, host_port, http_limit_options, http_limits
from moeswarm.errors import ConfigError
from moeswarm.protocol import peer_id_from_str, peer_id_to_str

from ._chain import ModelShape
from ._queries import default_key_path, list_receipts, load_key
from ._store import Ledger, StoreConfig

_DB = click.option("--db", default="ledger.db", show_default=True, metavar="PATH|URL",
                   help="SQLite file path or SQLAlchemy URL, e.g. postgresql://user@host/dbname.")
_KEY = click.option("--key", "key_path", type=click.Path(dir_okay=False), default=None,
                    help="The ledger's Ed25519 key (32-byte seed file). Default: DB.key beside a SQLite "
                         "file, else ./ledger.key.")
_BOOTSTRAP = click.option("--bootstrap", multiple=True, metavar="MULTIADDR",
                         help="A swarm peer to reach the DHT through, e.g. /ip4/1.2.3.4/tcp/4001/p2p/12D3Koo... "
                              "(repeatable).")
_FORMAT = click.option("--format", "fmt", type=click.Choice(["table", "json", "csv"]), default="table",
                       show_default=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
def main() -> None:
    """The moeswarm receipt ledger: dual-signed receipts of served expert-FLOPs in a hash chain."""


def _open(db: str, key_path: str | None = None, *, need_key: bool = False, create: bool = False,
          **config: Any) -> Ledger:
    identity = None
    if need_key or key_path:
        identity = load_key(key_path or default_key_path(db), create=create)
    return Ledger(StoreConfig(db, create=create, **config), identity)


def _time_ms(text: str | None, what: str) -> int | None:
    """ISO 8601 (UTC unless it says otherwise), or unix seconds / milliseconds."""
    if text is None:
        return None
    try:
        value = float(text)
        return int(value * 1000) if value < 1e11 else int(value)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ConfigError(f"--{what} takes ISO 8601 (2026-11-01T12:00) or unix seconds, not {text!r}") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return int(moment.timestamp() * 1000)


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    from rich.table import Table

    from moeswarm._cli_util import console

    table = Table(title=title)
    for c in columns:
        table.add_column(c, overflow="fold")
    for r in rows:
        table.add_row(*(str(v) for v in r))
    console().print(table)


@main.command()
@_DB
@click.argument("peer")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
@friendly_errors
def balance(db: str, peer: str, fmt: str) -> None:
    """PEER's credit (base58 peer ID): spendable balance, and as a server what it earned (settled,
    pending in escrow, withheld)."""
    from ._settlement import peer_balance

    with _open(db) as ledger:
        b = peer_balance(ledger, peer_id_from_str(peer))
    if fmt == "json":
        click.echo(json.dumps(b.to_json()))
        return
    d = b.to_json()
    _table(f"balance of {peer}", ["balance", "granted", "spent", "settled", "pending", "withheld", "expert_flops",
                                  "receipts", "flagged"],
           [[d["balance"], d["granted"], d["spent"], d["settled"], d["pending"], d["withheld"], d["expert_flops"],
             d["receipts"],
             f"yes ({b.evidence} failed audits)" if b.evidence else "no"]])


@main.command()
@_DB
@click.option("--peer", default=None, help="Only receipts whose client or server is this peer ID.")
@click.option("--model", default=None, help="Only this model id.")
@click.option("--layer", type=int, default=None, help="Only this MoE layer.")
@click.option("--since", default=None, help="Receipt time at or after (ISO 8601 or unix seconds).")
@click.option("--until", default=None, help="Receipt time before (ISO 8601 or unix seconds).")
@click.option("--limit", type=click.IntRange(1), default=None)
@_FORMAT
@friendly_errors
def receipts(db: str, peer: str | None, model: str | None, layer: int | None, since: str | None,
             until: str | None, limit: int | None, fmt: str) -> None:
    """List stored receipts in chain order."""
    with _open(db) as ledger:
        rows = list_receipts(ledger, peer=peer_id_from_str(peer) if peer else None, model=model, layer=layer,
                             since_ms=_time_ms(since, "since"), until_ms=_time_ms(until, "until"), limit=limit)
    items = [r.to_json() for r in rows]
    if fmt == "json":
        click.echo(json.dumps(items, indent=1))
    elif fmt == "csv":
        writer = csv.writer(sys.stdout)
        writer.writerow(list(items[0]) if items else ["position", "receipt_id"])
        for item in items:
            writer.writerow([" ".join(map(str, v)) if isinstance(v, list) else v for v in item.values()])
    else:
        _table(f"{len(items)} receipts", ["#", "receipt", "time (UTC)", "server", "client", "model", "layer",
                                          "experts", "tokens", "expert FLOPs"],
               [[r.position, r.receipt_id.hex()[:16], _iso(r.time_ms), "…" + peer_id_to_str(r.server)[-8:],
                 "…" + peer_id_to_str(r.client)[-8:], r.model_id, r.layer, ",".join(map(str, r.experts)),
                 r.tokens, f"{r.expert_flops:,}"] for r in rows])


@main.command()
@_DB
@click.option("--ledger-key", default=None, metavar="PEER_ID",
              help="The ledger's peer ID to require (default: the one recorded in the database).")
@friendly_errors
def verify(db: str, ledger_key: str | None) -> None:
    """Check the whole chain, every signature and every settlement; exit 1 naming the first bad entry."""
    from ._verify import verify_chain

    with _open(db) as ledger:
        report = verify_chain(ledger, ledger_key=peer_id_from_str(ledger_key) if ledger_key else None)
    if report.problem is not None:
        click.echo(f"BAD {report.problem}", err=True)
        sys.exit(1)
    click.echo(f"ok: {report.entries} entries, {report.settlements} settlements, {report.evidence} evidence "
               "records verify")


@main.command()
@_DB
@_KEY
@click.option("--epoch", type=click.IntRange(0), required=True, help="Epoch number (see `epochs`).")
@_BOOTSTRAP
@friendly_errors
def settle(db: str, key_path: str | None, epoch: int, bootstrap: tuple[str, ...]) -> None:
    """Settle an ended epoch: balances per server and a signed statement with the Merkle root.

    With --bootstrap, the epoch's signed root is also published in the swarm's DHT (again, if
    the epoch was settled before), where `root` and `check-proof --bootstrap` find it."""
    from ._settlement import settle_epoch

    with _open(db, key_path, need_key=True) as ledger:
        statement = settle_epoch(ledger, epoch)
        identity = ledger.identity
    click.echo(json.dumps(statement.to_json(), indent=1))
    if bootstrap:
        from ._roots import publish_root

        assert identity is not None
        root, stored = asyncio.run(publish_root(statement, identity, bootstrap))
        click.echo(f"published the root of epoch {epoch} ({root.merkle_root.hex()[:16]}) in the DHT: "
                   f"{stored} peers stored it", err=True)


@main.command()
@_BOOTSTRAP
@click.option("--ledger-peer", required=True, metavar="PEER_ID", help="The ledger's peer ID (base58).")
@click.option("--epoch", type=click.IntRange(0), required=True, help="Epoch number.")
@friendly_errors
def root(bootstrap: tuple[str, ...], ledger_peer: str, epoch: int) -> None:
    """Fetch a ledger's signed settlement root of an epoch from the DHT and verify it (JSON on stdout;
    exit 1 if the DHT holds none)."""
    from ._roots import fetch_root

    found = asyncio.run(fetch_root(peer_id_from_str(ledger_peer), epoch, bootstrap))
    if found is None:
        click.echo(f"BAD no settlement root of epoch {epoch} of {ledger_peer} in the DHT", err=True)
        sys.exit(1)
    click.echo(json.dumps(found.to_json(), indent=1))


def _check_dht_root(proof: Any, ledger: bytes, bootstrap: tuple[str, ...]) -> None:
    """Exit 1 unless the proof leads to the root the DHT holds for its epoch."""
    from ._roots import fetch_root, root_problem

    problem = root_problem(proof, asyncio.run(fetch_root(ledger, proof.epoch, bootstrap)))
    if problem is not None:
        click.echo(f"BAD proof: {problem}", err=True)
        sys.exit(1)
    click.echo(f"ok: the proof leads to the root in the DHT for epoch {proof.epoch}", err=True)


@main.command()
@_DB
@friendly_errors
def epochs(db: str) -> None:
    """Epochs with receipts, and whether each is settled."""
    from sqlalchemy import select

    from ._models import Entry, Settlement

    with _open(db) as ledger, ledger.read() as conn:
        sums: dict[int, list[int]] = {}
        for e, f in conn.execute(select(Entry.epoch, Entry.expert_flops)):  # Python ints: no SQL overflow
            t = sums.setdefault(e, [0, 0])
            t[0] += 1
            t[1] += int(f)
        rows = [(e, n, f) for e, (n, f) in sorted(sums.items())]
        settled = set(conn.execute(select(Settlement.epoch)).scalars())
        span = ledger.epoch_ms
    _table(f"epochs of {span // 1000} s", ["epoch", "starts (UTC)", "receipts", "expert FLOPs", "settled"],
           [[e, _iso(e * span), n, f"{f:,}", "yes" if e in settled else "no"] for e, n, f in rows])


@main.command()
@_DB
@click.argument("receipt_id")
@_BOOTSTRAP
@friendly_errors
def prove(db: str, receipt_id: str, bootstrap: tuple[str, ...]) -> None:
    """Merkle inclusion proof of a receipt (full hex id or a prefix) as JSON; check it with check-proof.

    With --bootstrap, also check it against the epoch's root in the DHT (exit 1 if it differs)."""
    from ._settlement import prove as make_proof

    with _open(db) as ledger:
        proof = make_proof(ledger, receipt_id)
        ledger_peer = ledger.ledger_peer_id
    click.echo(json.dumps(proof.to_json(), indent=1))
    if bootstrap:
        _check_dht_root(proof, ledger_peer, bootstrap)


@main.command("check-proof")
@click.argument("proof_file", type=click.File("r"))
@click.option("--ledger-key", default=None, metavar="PEER_ID", help="Require statements signed by this ledger.")
@_BOOTSTRAP
@friendly_errors
def check_proof_cmd(proof_file: Any, ledger_key: str | None, bootstrap: tuple[str, ...]) -> None:
    """Verify an inclusion proof (a file, or - for stdin) without the database.

    With --bootstrap, also require that it leads to the root the ledger published in the DHT for
    that epoch (the ledger is --ledger-key, else the signer of the proof's statement)."""
    from ._settlement import Proof, check_proof

    try:
        data = json.load(proof_file)
    except json.JSONDecodeError as e:
        raise ConfigError(f"the proof is not JSON: {e}") from None
    proof = Proof.from_json(data)
    problem = check_proof(proof, ledger_key=peer_id_from_str(ledger_key) if ledger_key else None)
    if problem is not None:
        click.echo(f"BAD proof: {problem}", err=True)
        sys.exit(1)
    if bootstrap:
        ledger = peer_id_from_str(ledger_key) if ledger_key else proof.statement.ledger if proof.statement else None
        if ledger is None:
            raise ConfigError("the proof holds no statement: name the ledger with --ledger-key")
        _check_dht_root(proof, ledger, bootstrap)
    signed = "in the signed statement of" if proof.statement else "in the (unsettled) tree of"
    click.echo(f"ok: receipt {proof.receipt_id.hex()[:16]} is leaf {proof.leaf_index} of {proof.tree_size} "
               f"{signed} epoch {proof.epoch}")


def _model_spec(text: str) -> tuple[str, ModelShape]:
    model_id, _, shape = text.partition("=")
    parts = shape.split(":")
    try:
        if not model_id or not 2 <= len(parts) <= 4:
            raise ValueError
        return model_id, ModelShape(*(int(p) for p in parts))
    except ValueError:
        raise ConfigError(f"--model takes MODEL_ID=HIDDEN:FFN[:TOP_K[:MAX_TOKENS]], not {text!r}") from None


def _checkpoint_shape(folder: str, model_id: str | None) -> tuple[str, ModelShape]:
    """A checkpoint's model id and its expert shape with per-call limits, from its config.json."""
    from moeswarm.model import load_config
    from moeswarm.model.model_id import model_id_for

    cfg = load_config(folder)
    return (model_id or model_id_for(folder, cfg),
            ModelShape(cfg.hidden_size, cfg.moe_intermediate_size, cfg.top_k))


@main.command()
@_DB
@_KEY
@click.option("--listen", default="127.0.0.1:8470", show_default=True, metavar="HOST:PORT",
              help="Where to serve HTTP (port 0 picks a free one).")
@click.option("--epoch-seconds", type=click.IntRange(1), default=3600, show_default=True,
              help="Epoch length, fixed when the ledger is created.")
@click.option("--model", "models", multiple=True, metavar="ID=HIDDEN:FFN[:TOP_K]",
              help="Register a model's expert shape for the FLOPs bound (repeatable; `models add --model DIR` "
                   "reads it from a checkpoint).")
@click.option("--model-dir", "model_dirs", multiple=True, metavar="DIR[=ID]",
              help="A checkpoint: registers its shape and audits its calls (POST /v1/audits). Repeatable.")
@click.option("--audit-tolerance", type=click.FloatRange(0), default=1e-2, show_default=True,
              help="Largest max|output - reference| / max(1, max|reference|) an audited call may show.")
@click.option("--verify-threads", type=click.IntRange(1, 64), default=2, show_default=True,
              help="Threads checking the signatures of one batch.")
@http_limit_options
@friendly_errors
def serve(db: str, key_path: str | None, listen: str, epoch_seconds: int, models: tuple[str, ...],
          model_dirs: tuple[str, ...], audit_tolerance: float, verify_threads: int, **http: Any) -> None:
    """Run the ingestion service; prints READY {json} on stdout when it accepts receipts."""
    from moeswarm.daemon import check_listen, listen_problem, ready, run_daemon, say, stop_event
    from moeswarm.model import load_weights

    from ._audit import AuditConfig
    from ._evidence import LocalJudge
    from ._service import LedgerService, ServiceConfig, ready_info

    host, port = host_port(listen, default_host="127.0.0.1")
    check_listen(host, port, "--listen")
    shapes = [_model_spec(m) for m in models]
    weights = {}
    for spec in model_dirs:
        folder, _, model_id = spec.partition("=")
        w = load_weights(folder)
        model_id, shape = _checkpoint_shape(folder, model_id or None)
        weights[model_id] = w
        shapes.append((model_id, shape))
    ledger = _open(db, key_path, need_key=True, create=True, epoch_s=epoch_seconds, verify_threads=verify_threads)
    for model_id, shape in shapes:
        ledger.register_model(model_id, shape)
    judge = LocalJudge(ledger, weights, AuditConfig(tolerance=audit_tolerance)) if weights else None

    async def run() -> None:
        stop = stop_event()
        config = ServiceConfig(host=host, port=port, limits=http_limits(http))
        service = LedgerService(ledger, config, judge=judge)
        try:
            await service.start()
        except OSError as e:
            raise ConfigError(f"--listen {listen}: {listen_problem(e)}") from None
        try:
            info = ready_info(service)
            ready(info)
            say(f"serving the ledger at {info.get('url', listen)} (Ctrl-C to stop)")
            await stop.wait()
        finally:
            await service.aclose()

    try:
        run_daemon(run())
    finally:
        ledger.close()


@main.command()
@_DB
@_KEY
@click.argument("peer")
@click.argument("amount", type=click.IntRange(1))
@click.option("--json", "as_json", is_flag=True, help="Print the signed grant record and the new balance as JSON.")
@friendly_errors
def grant(db: str, key_path: str | None, peer: str, amount: int, as_json: bool) -> None:
    """Grant AMOUNT credits to PEER (base58 peer ID), signed by the ledger's key.

    The only way credit enters the ledger: every receipt moves credit from its client to its
    server, so the sum of all balances (and escrow) always equals the sum of grants."""
    with _open(db, key_path, need_key=True) as ledger:
        record = ledger.grant(peer_id_from_str(peer), amount)
        balance = ledger.balance(record.peer)
    if as_json:
        click.echo(json.dumps({**record.to_json(), "balance": balance}))
        return
    click.echo(f"granted {amount} credits to {peer}: balance now {balance}")


@main.group()
def models() -> None:
    """The models whose receipts this ledger accepts (only the operator registers them)."""


@models.command("add")
@_DB
@_KEY
@click.option("--model", "model_dirs", multiple=True, required=True, metavar="DIR[=ID]",
              help="A checkpoint folder: its config.json gives the expert shape and experts per token.")
@click.option("--epoch-seconds", type=click.IntRange(1), default=3600, show_default=True,
              help="Epoch length, if this creates the ledger.")
@friendly_errors
def models_add(db: str, key_path: str | None, model_dirs: tuple[str, ...], epoch_seconds: int) -> None:
    """Register models' expert shapes and per-call limits (creates the ledger if needed)."""
    with _open(db, key_path, need_key=True, create=True, epoch_s=epoch_seconds) as ledger:
        for spec in model_dirs:
            folder, _, model_id = spec.partition("=")
            mid, shape = _checkpoint_shape(folder, model_id or None)
            created = ledger.register_model(mid, shape)
            click.echo(json.dumps({"model_id": mid, "hidden": shape.hidden, "ffn": shape.ffn, "top_k": shape.top_k,
                                   "max_tokens": shape.token_limit, "created": created}))


@models.command("list")
@_DB
@friendly_errors
def models_list(db: str) -> None:
    """The registered models, as JSON lines."""
    with _open(db) as ledger:
        for mid, shape in sorted(ledger.models().items()):
            click.echo(json.dumps({"model_id": mid, "hidden": shape.hidden, "ffn": shape.ffn, "top_k": shape.top_k,
                                   "max_tokens": shape.token_limit}))


if __name__ == "__main__":
    main()
