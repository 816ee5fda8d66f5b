"""The ledger's throughput next to its limit: raw Ed25519 verifications per second on this machine.

Every receipt carries two Ed25519 signatures (the server's and the client's countersignature),
so ingestion can never beat half the raw verify rate on one core; the goal is to stay within
3x of the raw rate. Rows, each on one thread unless it says otherwise:

1. raw Ed25519 verify/s (cryptography/OpenSSL, a receipt-sized message): the limit;
2. receipt checks/s: decode + both signatures + hashes (``Ledger.prepare``), no database;
3. ingest/s into SQLite and PostgreSQL: ``Ledger.ingest`` of encoded receipts in batches of
   ``--batch``, one transaction per batch, acknowledged after the commit (SQLite WAL,
   synchronous=FULL; PostgreSQL as configured, its fsync settings are printed); once more with
   ``verify_threads=2`` (both cores check signatures);
4. ingest/s end to end over HTTP: ``ReceiptSubmitter`` -> ``LedgerService`` -> SQLite;
5. verify/s: ``verify_chain`` (every link, both signatures, every column) on each backend.

    python benchmarks/ledger.py [--receipts 20000] [--batch 512] [--repeat 3] [--pg URL]

The machine's cores are shared, so each rate is the best of ``--repeat`` runs (ingestion into a
fresh database each time).

PostgreSQL comes from --pg, else MOESWARM_TEST_PG_URL, else scripts/test-setup.sh starts a
private server for the run (and stops it).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import asyncio
import itertools
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from cryptography.hazmat.primitives.asymmetric import ed25519
from sqlalchemy import create_engine, text

from moeswarm.ledger import (
    Ledger,
    LedgerService,
    ModelShape,
    ReceiptSubmitter,
    StoreConfig,
    SubmitterConfig,
    verify_chain,
)
from moeswarm.protocol import (
    ExpertRequest,
    ExpertRows,
    Identity,
    countersign,
    encode,
    make_receipt,
)

ROOT = Path(__file__).resolve().parents[1]
MODEL, H, F = "bench/moe", 64, 128


CLIENTS = [Identity.from_seed(bytes([i + 1]) * 32) for i in range(4)]  # funded by open_ledger


def make_receipts(n: int) -> list[bytes]:
    """n encoded countersigned receipts from 4 clients to 8 servers, 2 tokens x 2 experts each."""
    clients = CLIENTS
    servers = [Identity.generate() for _ in range(8)]
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((2, H)).astype(np.float32)
    outputs = rng.standard_normal((4, H)).astype(np.float32)
    rows = np.arange(2, dtype=np.uint32)
    seq = itertools.count(1)
    out = []
    for i in range(n):
        c, s = clients[i % 4], servers[i % 8]
        req = ExpertRequest(os.urandom(16), MODEL, i % 24, next(seq), hidden, (ExpertRows(3, rows), ExpertRows(7, rows)))
        r = make_receipt(s, req, outputs, client=c.peer_id, expert_flops=6 * H * F * 4, time_ms=1_700_000_000_000 + i)
        out.append(encode(countersign(c, r)))
    return out


def rate(n: int, fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return n / (time.perf_counter() - t0)


def raw_verify_rate(n: int, threads: int = 1) -> float:
    """Ed25519 verifications per second with ``threads`` threads verifying at once (OpenSSL releases
    the GIL), so a row that uses two verify threads is compared with the two-thread limit."""
    key = ed25519.Ed25519PrivateKey.generate()
    pub, msg = key.public_key(), os.urandom(330)
    sig = key.sign(msg)
    share = n // threads

    def work() -> None:
        for _ in range(share):
            pub.verify(sig, msg)

    def run() -> None:
        with ThreadPoolExecutor(threads) as pool:
            for f in [pool.submit(work) for _ in range(threads)]:
                f.result()

    return rate(share * threads, run)


def open_ledger(url: str, threads: int = 1) -> Ledger:
    led = Ledger(StoreConfig(url, create=True, verify_threads=threads), Identity.generate())
    led.register_model(MODEL, ModelShape(H, F))
    for c in CLIENTS:  # the operator's grants: every receipt moves credit from its client to its server
        led.grant(c.peer_id, 2**60)
    return led


def ingest_rate(led: Ledger, receipts: list[bytes], batch: int) -> float:
    def run() -> None:
        for i in range(0, len(receipts), batch):
            results = led.ingest(receipts[i : i + batch])
            assert all(r.status == "accepted" for r in results)
    return rate(len(receipts), run)


def http_rate(url: str, receipts: list[bytes], batch: int, queue: Path) -> float:
    from moeswarm.protocol import decode

    decoded = [decode(r) for r in receipts]  # the sink takes receipt objects, as from the backbone
    led = open_ledger(url)

    async def main() -> float:
        async with LedgerService(led) as service:
            config = SubmitterConfig(batch_size=batch, max_delay_s=0.05)
            async with ReceiptSubmitter(service.url, queue, config) as submitter:
                t0 = time.perf_counter()
                for cr in decoded:
                    submitter(cr)  # type: ignore[arg-type]
                assert await submitter.flush(600)
                return len(decoded) / (time.perf_counter() - t0)

    try:
        return asyncio.run(main())
    finally:
        led.close()


def postgres(arg: str | None, cleanup: list[Callable[[], None]]) -> tuple[str | None, str]:
    """(base URL, note) of a PostgreSQL database to benchmark in, or (None, why not)."""
    url = arg or os.environ.get("MOESWARM_TEST_PG_URL")
    if not url:
        folder = tempfile.mkdtemp(prefix="moeswarm-bench-pg-")
        os.chmod(folder, 0o755)
        env = {**os.environ, "MOESWARM_PG_DIR": folder, "MOESWARM_PG_STOP_MODE": "immediate"}
        out = subprocess.run(["bash", str(ROOT / "scripts" / "test-setup.sh")], env=env, capture_output=True, text=True)
        if out.returncode != 0:
            return None, "scripts/test-setup.sh failed: " + out.stderr.strip().splitlines()[-1]
        url = out.stdout.strip().split("=", 1)[1].strip("'")

        def stop() -> None:
            subprocess.run(["bash", str(ROOT / "scripts" / "test-setup.sh"), "stop"], env=env, capture_output=True)
            shutil.rmtree(folder, ignore_errors=True)

        cleanup.append(stop)
    engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    with engine.begin() as conn:
        note = (f"fsync={conn.execute(text('SHOW fsync')).scalar()}, "
                f"synchronous_commit={conn.execute(text('SHOW synchronous_commit')).scalar()}")
    engine.dispose()
    return url, note


def pg_schema_url(base: str | None, name: object) -> str:
    return f"{base}{'&' if '?' in str(base) else '?'}options=-csearch_path%3Dbench_{os.getpid()}_{name}"


def pg_schema(base: str, name: str, cleanup: list[Callable[[], None]]) -> str:
    """A fresh schema in ``base``, dropped at the end, as a URL whose search_path points at it."""
    schema = f"bench_{os.getpid()}_{name}"
    engine = create_engine(base.replace("postgresql://", "postgresql+psycopg://", 1))
    with engine.begin() as conn:
        conn.execute(text(f"CREATE SCHEMA {schema}"))

    def drop() -> None:
        with engine.begin() as conn:
            conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
        engine.dispose()

    cleanup.append(drop)
    return pg_schema_url(base, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--receipts", type=int, default=20_000)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3, help="runs per row; the best is shown")
    ap.add_argument("--pg", default=None, help="PostgreSQL URL (default: MOESWARM_TEST_PG_URL or a private server)")
    args = ap.parse_args()
    n = args.receipts
    print(f"making {n} countersigned receipts ...", flush=True)
    receipts = make_receipts(n)
    cleanup: list[Callable[[], None]] = []
    rows: list[tuple[str, float | None, str, int]] = []  # label, rate, note, threads verifying
    try:
        best = lambda fn: max(fn() for _ in range(args.repeat))  # noqa: E731
        raw = {t: best(lambda t=t: raw_verify_rate(min(n, 20_000), t)) for t in (1, 2)}
        rows.append(("raw Ed25519 verify/s (the limit)", raw[1], "1 signature, 1 thread", 1))
        rows.append(("raw Ed25519 verify/s, 2 threads", raw[2], "1 signature, the limit of 2-thread rows", 2))
        with tempfile.TemporaryDirectory() as tmp:
            led = open_ledger(str(Path(tmp) / "prep.db"))
            rows.append(("receipt checks/s (decode + 2 verifies)", best(lambda: rate(n, lambda: led.prepare(receipts))),
                         "no database", 1))
            led.close()
            fresh = itertools.count()
            pg_base, pg_note = postgres(args.pg, cleanup)
            for name, note in (("SQLite", "WAL, synchronous=FULL"), ("PostgreSQL", pg_note)):
                if name == "PostgreSQL" and pg_base is None:
                    rows.append(("ingest/s PostgreSQL", None, pg_note, 1))
                    continue
                for threads in (1, 2):
                    def one_run() -> float:
                        i = next(fresh)
                        url = (str(Path(tmp) / f"ledger{i}.db") if name == "SQLite"
                               else pg_schema(str(pg_base), str(i), cleanup))
                        with open_ledger(url, threads) as led:
                            return ingest_rate(led, receipts, args.batch)

                    label = f"ingest/s {name}" + (f", {threads} verify threads" if threads > 1 else "")
                    rows.append((label, best(one_run), f"batches of {args.batch}; {note}", threads))
                # verify the chain the last run left
                last = next(fresh) - 1
                url = str(Path(tmp) / f"ledger{last}.db") if name == "SQLite" else pg_schema_url(pg_base, last)
                with Ledger(StoreConfig(url)) as led:
                    rows.append((f"verify/s {name}", best(lambda: rate(n, lambda: verify_chain(led))), "whole chain", 1))
            rows.append(("ingest/s over HTTP -> SQLite",
                         best(lambda: http_rate(str(Path(tmp) / f"http{next(fresh)}.db"), receipts, args.batch,
                                                Path(tmp) / f"queue{next(fresh)}")),
                         "end to end: submitter + HTTP service, 1 verify thread", 1))
    finally:
        for fn in reversed(cleanup):
            fn()
    print(f"\n{n} receipts, best of {args.repeat}, on {os.cpu_count()} shared cores. x1 = raw Ed25519 verify/s "
          "with as many threads as the row verifies on, divided by the row's rate (the goal: <= 3);\n"
          f"x2 = the same against the 2-signature receipt limit (1 thread: {raw[1] / 2:,.0f} receipts/s, "
          f"2 threads: {raw[2] / 2:,.0f})\n")
    print(f"{'':44} {'per second':>12} {'x1':>6} {'x2':>6}   notes")
    for label, value, note, threads in rows:
        limit = raw[threads]
        shown = f"{value:12,.0f} {limit / value:6.2f} {limit / 2 / value:6.2f}" if value else f"{'skipped':>12} {'':>13}"
        print(f"{label:44} {shown}   {note}")


if __name__ == "__main__":
    main()
