"""The backbone's side of ingestion: ``ReceiptSubmitter``, a receipt sink that never loses a receipt.

``submitter(receipt)`` is non-blocking and thread-safe: it encodes the receipt and appends it to
an in-memory buffer. A background task cuts the buffer into batches (``batch_size`` receipts, or
whatever arrived within ``max_delay_s``), writes each batch to a spool file in ``queue_dir``
(write to a temporary name, then rename), and only then posts it to the ledger. A spool file is
deleted once the ledger has answered for every receipt in it (accepted, duplicate or rejected:
each decided after the ledger's commit); receipts the ledger could not decide yet ("retry") go
into a new spool file. While the ledger is unreachable, spool files pile up and are resent,
oldest first, with exponential back-off; files left by an earlier run are sent on ``start``.
So a receipt is only ever forgotten after the ledger acknowledged it; what a crash can lose is
at most the last ``max_delay_s`` of receipts not yet spooled.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgpack

from moeswarm.errors import ConfigError
from moeswarm.protocol import BatchedReceipt, CountersignedReceipt, encode

from .._tasks import cancel_and_wait
from ._ingest import IngestResult

log = logging.getLogger(__name__)
_SUFFIX = ".spool"


@dataclass(frozen=True)
class SubmitterConfig:
    """Batching, spooling and retry policy of a ``ReceiptSubmitter``. Times are seconds."""

    batch_size: int = 512  # receipts per POST (the service accepts up to 4096)
    max_delay_s: float = 0.2  # a receipt waits at most this long before its batch is spooled and sent
    retry_initial_s: float = 0.2  # first back-off after a failed POST
    retry_max_s: float = 5.0  # back-off ceiling
    request_timeout_s: float = 30.0  # one POST, connection included
    close_timeout_s: float = 5.0  # aclose() tries this long to deliver; the rest stays spooled
    fsync: bool = False  # fsync spool files: survive power loss too, not only a process crash


class ReceiptSubmitter:
    """A ``ReceiptSink`` for ``RemoteExperts.receipts`` that delivers to a ledger service at ``url``."""

    def __init__(self, url: str, queue_dir: str | os.PathLike[str], config: SubmitterConfig = SubmitterConfig(),
                 *, on_result: Callable[[IngestResult], None] | None = None) -> None:
        if config.batch_size < 1:
            raise ConfigError("batch_size must be at least 1")
        self.url = url.rstrip("/")
        self.queue_dir = Path(queue_dir)
        self.config = config
        self.on_result = on_result  # called on the event loop with every acknowledged result
        self._buffer: list[bytes] = []
        self._buffer_lock = threading.Lock()
        self._segments: list[Path] = []  # spool files, oldest first
        self._sizes: dict[Path, int] = {}  # receipts in each spool file
        self._next_segment = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._lock_fd: int | None = None
        self._closing = False
        self._closed = False
        self.stats = {"accepted": 0, "duplicate": 0, "rejected": 0, "retry": 0, "posts": 0, "failures": 0}

    # ------------------------------------------------------------------ the sink

    def __call__(self, receipt: CountersignedReceipt | BatchedReceipt) -> None:
        """Queue one countersigned receipt; returns at once (from any thread)."""
        data = encode(receipt)
        if self._closed:  # after aclose (e.g. a backbone settling its last receipts): straight to disk
            with self._buffer_lock:
                self._write_segment([data])
            return
        with self._buffer_lock:
            self._buffer.append(data)
            first = len(self._buffer) == 1
        if (first or len(self._buffer) >= self.config.batch_size) and self._loop is not None:
            self._loop.call_soon_threadsafe(self._poke)

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    @property
    def pending(self) -> int:
        """Receipts not yet acknowledged: buffered plus spooled."""
        return len(self._buffer) + sum(self._sizes.values())

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self.queue_dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.queue_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = None
            raise ConfigError(f"another submitter is using {self.queue_dir}") from None
        for tmp in self.queue_dir.glob("*.tmp"):
            tmp.unlink()  # a spool file half-written when a previous run died: never acknowledged to anyone
        self._segments = sorted(self.queue_dir.glob("*" + _SUFFIX))
        self._sizes = {p: len(_read_segment(p)) for p in self._segments}
        self._next_segment = 1 + max((int(p.name[:20]) for p in self._segments), default=0)
        self._loop = asyncio.get_running_loop()
        self._wake, self._idle = asyncio.Event(), asyncio.Event()
        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout_s)
        self._session = aiohttp.ClientSession(timeout=timeout)
        self._task = asyncio.create_task(self._run())
        self._wake.set()

    async def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued receipt has been acknowledged; False if ``timeout`` passed first."""
        assert self._idle is not None and self._wake is not None, "start() first"
        self._wake.set()
        try:
            async with asyncio.timeout(timeout):
                while self._buffer or self._segments:
                    self._idle.clear()
                    self._wake.set()
                    await self._idle.wait()
        except TimeoutError:
            return False
        return True

    async def aclose(self) -> None:
        """Deliver what is queued (for up to ``close_timeout_s``), spool the rest, stop."""
        if self._task is None:
            return
        self._closing = True
        with contextlib.suppress(Exception):
            await self.flush(self.config.close_timeout_s)
        await cancel_and_wait(self._task)
        self._task = None
        self._closed = True
        self._spool_buffer()  # anything that arrived meanwhile
        if self._session is not None:
            await self._session.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    async def __aenter__(self) -> ReceiptSubmitter:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ the background task

    async def _run(self) -> None:
        assert self._wake is not None and self._idle is not None
        backoff = self.config.retry_initial_s
        while True:
            if not self._segments:
                if not self._buffer:
                    self._idle.set()
                    await self._wake.wait()
                    self._wake.clear()
                    continue
                await self._collect()
            try:
                self._spool_buffer()
                if not self._segments:
                    continue
                if await self._send(self._segments[0]):
                    backoff = self.config.retry_initial_s
                    continue
            except OSError as e:  # the spool folder failed us: keep everything, try again later
                log.error("cannot write the receipt spool in %s: %s", self.queue_dir, e)
            self.stats["failures"] += 1
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.config.retry_max_s)

    async def _collect(self) -> None:
        """Let a batch fill up for at most ``max_delay_s``."""
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.max_delay_s
        while len(self._buffer) < self.config.batch_size and not self._closing:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await self._wake.wait()

    def _spool_buffer(self) -> None:
        with self._buffer_lock:
            items, self._buffer = self._buffer, []
        for i in range(0, len(items), self.config.batch_size):
            try:
                self._write_segment(items[i : i + self.config.batch_size])
            except OSError:
                with self._buffer_lock:  # keep what could not be written (disk full ...) in memory
                    self._buffer[:0] = items[i:]
                raise

    def _write_segment(self, items: list[bytes]) -> None:
        # ordered by the counter; the random part keeps two writers (a closed submitter and its
        # successor on the same folder) from ever choosing the same name
        path = self.queue_dir / f"{self._next_segment:020d}-{uuid.uuid4().hex[:12]}{_SUFFIX}"
        self._next_segment += 1
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as fh:
            fh.write(msgpack.packb(items, use_bin_type=True))
            if self.config.fsync:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
        self._segments.append(path)
        self._sizes[path] = len(items)

    async def _send(self, path: Path) -> bool:
        """POST one spool file; True when the ledger answered for all of it (file removed)."""
        assert self._session is not None
        items = _read_segment(path)
        body = msgpack.packb({"receipts": items}, use_bin_type=True)
        try:
            self.stats["posts"] += 1
            async with self._session.post(f"{self.url}/v1/receipts", data=body,
                                          headers={"Content-Type": "application/msgpack"}) as resp:
                if resp.status >= 500 or resp.status in (408, 429):
                    return False
                answer: Any = await resp.json() if resp.status == 200 else None
                if resp.status != 200:
                    log.error("the ledger refused a whole batch (%s): %s; keeping it in %s", resp.status,
                              await resp.text(), path.parent / "refused")
                    (path.parent / "refused").mkdir(exist_ok=True)
                    os.replace(path, path.parent / "refused" / path.name)
                    self._forget(path)
                    return True
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:
            log.info("ledger at %s unreachable (%s); %d spool files wait", self.url, e, len(self._segments))
            return False
        try:
            results = [IngestResult.from_json(r) for r in answer["results"]]
        except (KeyError, TypeError, ValueError) as e:
            log.error("the ledger's answer does not parse (%s); will resend", e)
            return False
        if len(results) != len(items):
            log.error("the ledger answered %d results for %d receipts; will resend", len(results), len(items))
            return False
        retry = [item for item, r in zip(items, results) if not r.acknowledged]
        if retry:
            self._write_segment(retry)
        for r in results:
            self.stats[r.status] += 1
            if r.status == "rejected":
                log.warning("the ledger rejected a receipt: %s %s", r.reason, r.message)
            if r.acknowledged and self.on_result is not None:
                self.on_result(r)
        path.unlink()
        self._forget(path)
        return not retry

    def _forget(self, path: Path) -> None:
        self._segments.remove(path)
        self._sizes.pop(path, None)


def _read_segment(path: Path) -> list[bytes]:
    items = msgpack.unpackb(path.read_bytes(), raw=False)
    return [bytes(i) for i in items]
