"""The HTTP listener for /metrics, /healthz and /readyz: one thread, one event loop, no thread per client.

Why not ``http.server`` or prometheus_client's own server: both give every connection a thread
and no deadline, so on a host-network port 200 half-sent requests pinned 200 threads for good.
Here a client costs a socket and a small coroutine, not a thread: its whole request head must
arrive within ``request_timeout`` and fit in ``max_request_bytes``, at most ``max_clients`` are
open at once (a new one closes the longest-waiting one), and the response is written with the
same deadline. Only ``GET`` and ``HEAD`` of a fixed set of paths are answered; every response
closes the connection. A client that goes away mid-request is counted, never printed.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

Response = tuple[int, bytes, str]  # status, body, content type
Route = Callable[[], Response]

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}


@dataclass
class ListenerStats:
    served: int = 0  # responses written
    timed_out: int = 0  # request head not complete within the deadline (slow or idle clients)
    evicted: int = 0  # closed to make room for a new client at max_clients
    rejected: int = 0  # malformed, oversized or not GET/HEAD
    dropped: int = 0  # the client went away mid-request


class Listener:
    """Serves ``routes`` (path -> handler) on ``host:port`` from one background thread."""

    def __init__(
        self,
        routes: Mapping[str, Route],
        host: str,
        port: int,
        *,
        max_clients: int = 128,
        request_timeout: float = 5.0,
        max_request_bytes: int = 8192,
    ) -> None:
        self.routes = dict(routes)
        self.host = host
        self.max_clients = max_clients
        self.request_timeout = request_timeout
        self.max_request_bytes = max_request_bytes
        self.stats = ListenerStats()
        self._clients: dict[asyncio.StreamWriter, None] = {}  # open connections, oldest first
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        try:
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._serve, host, port, limit=max_request_bytes, backlog=128)
            )
        except BaseException:
            self._loop.close()
            raise  # OSError: the caller names the address (in use, not on this host, ...)
        self.port: int = self._server.sockets[0].getsockname()[1]
        self._thread = threading.Thread(target=self._loop.run_forever, name="http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if not self._thread.is_alive():
            self._loop.close()
            return

        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for w in list(self._clients):
                w.close()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def open_clients(self) -> int:
        return len(self._clients)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        clients = self._clients
        clients[writer] = None
        while len(clients) > self.max_clients:
            oldest = next(iter(clients))
            del clients[oldest]
            oldest.close()
            self.stats.evicted += 1
        try:
            await asyncio.wait_for(self._exchange(reader, writer), self.request_timeout)
        except TimeoutError:
            self.stats.timed_out += 1
        except (ConnectionError, asyncio.IncompleteReadError):
            if writer in clients:  # not one this listener closed to make room (counted as evicted)
                self.stats.dropped += 1
        except asyncio.LimitOverrunError:
            self.stats.rejected += 1
        except Exception:  # a handler bug must not take the listener down
            log.exception("metrics listener: request failed")
        finally:
            clients.pop(writer, None)
            writer.close()

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            await self._respond(writer, (400, b"request too large\n", "text/plain"), head_only=False)
            raise
        parts = head.split(b"\r\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            self.stats.rejected += 1
            await self._respond(writer, (400, b"bad request\n", "text/plain"), head_only=False)
            return
        method, target = parts[0], parts[1]
        if method not in (b"GET", b"HEAD"):
            self.stats.rejected += 1
            await self._respond(writer, (405, b"only GET and HEAD\n", "text/plain"), head_only=False)
            return
        route = self.routes.get(target.split(b"?", 1)[0].decode("latin-1"))
        response = route() if route is not None else (404, b"not found\n", "text/plain")
        await self._respond(writer, response, head_only=method == b"HEAD")
        self.stats.served += 1

    async def _respond(self, writer: asyncio.StreamWriter, response: Response, *, head_only: bool) -> None:
        code, body, ctype = response
        head = (
            f"HTTP/1.1 {code} {_REASONS.get(code, 'Error')}\r\n"
            f"Content-Type: {ctype}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode("latin-1")
        writer.write(head if head_only else head + body)
        await writer.drain()
