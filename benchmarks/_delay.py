"""A TCP proxy that delays each direction by a fixed time (and can cap its bandwidth):
userspace link emulation, since this kernel has no netem qdisc.  Bytes keep their order; a
chunk read at t is written at t + delay (or later, when the bandwidth cap says so)."""

from __future__ import annotations

import asyncio
import time
from collections import deque


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float,
                bytes_per_s: float | None) -> None:
    queue: deque[tuple[float, bytes]] = deque()
    ready = asyncio.Event()
    done = False

    async def sender() -> None:
        link_free = 0.0
        while True:
            while not queue:
                if done:
                    writer.close()
                    return
                ready.clear()
                await ready.wait()
            due, chunk = queue.popleft()
            if bytes_per_s:
                link_free = max(link_free, due - delay_s) + len(chunk) / bytes_per_s
                due = max(due, link_free + delay_s)
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(chunk)
            await writer.drain()

    task = asyncio.create_task(sender())
    try:
        while chunk := await reader.read(1 << 16):
            queue.append((time.monotonic() + delay_s, chunk))
            ready.set()
    except (ConnectionError, OSError):
        pass
    finally:
        done = True
        ready.set()
        try:
            await task
        except (ConnectionError, OSError):
            pass


async def start_delay_proxy(listen_port: int, target_port: int, delay_s: float,
                            bytes_per_s: float | None = None) -> asyncio.base_events.Server:
    """Forward 127.0.0.1:listen_port -> 127.0.0.1:target_port with ``delay_s`` each way."""

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", target_port)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(_pump(client_r, server_w, delay_s, bytes_per_s),
                             _pump(server_r, client_w, delay_s, bytes_per_s))

    return await asyncio.start_server(handle, "127.0.0.1", listen_port)
