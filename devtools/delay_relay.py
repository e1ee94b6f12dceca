"""A TCP relay that delays every byte by a set time, both ways: latency on one link, where netem is missing.

Run as a plain script (standard library only) inside a broker's network namespace by
:mod:`devtools.kafka_cluster`: ``python delay_relay.py LISTEN_HOST LISTEN_PORT TARGET_HOST TARGET_PORT
DELAY_FILE``. The delay (milliseconds, a number in ``DELAY_FILE``; missing or empty: 0) is read again every
0.1 s, and applies to data read from then on: a chunk read at ``t`` is written at ``t + delay``, in order.
Kernels without ``sch_netem`` (this test machine's) cannot delay a link with ``tc``; a relay in front of one
listener delays that listener's clients only, which is the fault wanted (the exporter's link, not the
brokers' replication).
"""

from __future__ import annotations

import asyncio
import sys
import time


class Delay:
    """The current delay in seconds, from the file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.seconds = 0.0

    async def watch(self) -> None:
        while True:
            try:
                with open(self.path) as fh:
                    text = fh.read().strip()
                self.seconds = float(text) / 1000 if text else 0.0
            except (OSError, ValueError):
                self.seconds = 0.0
            await asyncio.sleep(0.1)


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: Delay) -> None:
    """Copy ``reader`` to ``writer``, each chunk held until ``delay`` after it was read (order kept)."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def send() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                break
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        writer.close()

    sender = asyncio.ensure_future(send())
    try:
        while True:
            data = await reader.read(65536)
            await queue.put((time.monotonic() + delay.seconds, data))
            if not data:
                break
        await sender
    except (ConnectionError, OSError):
        sender.cancel()
        writer.close()


async def main(listen_host: str, listen_port: int, target_host: str, target_port: int, delay_file: str) -> None:
    delay = Delay(delay_file)
    watcher = asyncio.ensure_future(delay.watch())

    async def serve(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(target_host, target_port)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(pipe(client_r, server_w, delay), pipe(server_r, client_w, delay))

    server = await asyncio.start_server(serve, listen_host, listen_port)
    async with server:
        await server.serve_forever()
    watcher.cancel()


if __name__ == "__main__":
    host, port, thost, tport, path = sys.argv[1:6]
    asyncio.run(main(host, int(port), thost, int(tport), path))
