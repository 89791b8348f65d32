"""The server's listening socket, whose accept loop holds the socket cap where connections arrive.

asyncio's own accept loop takes every pending connection (up to 100 a wake-up) as soon as the
listening socket is readable, and gives each a transport and a protocol before the protocol can
refuse it. The connection cap in ``limits.py`` then closes the surplus, but each socket it answers
lingers, and under a burst the process held hundreds of descriptors beyond ``--web.max-connections``.
:class:`CappedListener` accepts by itself, and only while fewer than ``limit`` of the sockets it
accepted are open (closing and lingering ones included); at the limit it stops reading the listening
socket. Connections that arrive meanwhile wait in the kernel's backlog, costing the process no
descriptor, and are accepted as sockets close. :class:`CappedSite` serves an aiohttp runner through it.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable

from aiohttp import web

from .limits import LimitedRequestHandler

log = logging.getLogger("gpuscope.server")

#: Connections accepted per wake-up of the listening socket at most, so that the loop's other
#: callbacks (answers, deadlines) run between batches of a burst.
ACCEPT_BATCH = 64
#: After ``accept()`` found the process or the host out of descriptors or memory: how long to wait
#: before accepting again (asyncio waits as long), instead of spinning on a socket that stays readable.
RETRY_S = 1.0
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)

HandlerFactory = Callable[[], LimitedRequestHandler]


class _Slot:
    """One accepted socket in its listener's count, given back once however it ends."""

    __slots__ = ("_listener",)

    def __init__(self, listener: CappedListener) -> None:
        self._listener: CappedListener | None = listener

    def release(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener._released()


class CappedListener(asyncio.AbstractServer):
    """Accepts on ``sockets`` while fewer than ``limit`` accepted sockets are open; each connection's
    protocol comes from ``factory``. Stands where aiohttp's sites keep asyncio's server."""

    def __init__(self, sockets: list[socket.socket], factory: HandlerFactory, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, not {limit}")
        self._loop = asyncio.get_running_loop()
        self._sockets = sockets
        self._factory = factory
        self.limit = limit
        #: Accepted sockets not closed yet: the descriptors the server's connections hold.
        self.open = 0
        self._reading = False
        self._closed = False
        self._retry: asyncio.TimerHandle | None = None
        self._starting: set[asyncio.Task] = set()
        self._resume()

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        return tuple(self._sockets)

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def is_serving(self) -> bool:
        return not self._closed

    def close(self) -> None:
        """Stop accepting and close the listening sockets; connections already made stay open, those
        still being set up are dropped."""
        if self._closed:
            return
        self._pause()
        self._closed = True
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        for sock in self._sockets:
            sock.close()
        self._sockets = []
        for task in self._starting:
            task.cancel()

    async def wait_closed(self) -> None:
        return None

    # --- the accept loop ---------------------------------------------------------------------------
    def _resume(self) -> None:
        if self._reading or self._closed or self._retry is not None:
            return
        for sock in self._sockets:
            self._loop.add_reader(sock.fileno(), self._accept, sock)
        self._reading = True

    def _pause(self) -> None:
        if not self._reading:
            return
        for sock in self._sockets:
            self._loop.remove_reader(sock.fileno())
        self._reading = False

    def _accept(self, listening: socket.socket) -> None:
        for _ in range(ACCEPT_BATCH):
            if self.open >= self.limit:
                self._pause()  # the kernel holds the next ones until a socket closes (_released)
                return
            try:
                conn, _ = listening.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:
                if exc.errno not in _OUT_OF_RESOURCES:
                    log.warning("accepting a connection failed: %s", exc)
                    return
                log.warning("cannot accept connections (%s): trying again in %gs", exc.strerror, RETRY_S)
                self._pause()
                self._retry = self._loop.call_later(RETRY_S, self._retried)
                return
            conn.setblocking(False)
            self.open += 1
            task = self._loop.create_task(self._start(conn, _Slot(self)))
            self._starting.add(task)  # a reference until it is done: the loop keeps only a weak one
            task.add_done_callback(self._starting.discard)

    async def _start(self, conn: socket.socket, slot: _Slot) -> None:
        def protocol() -> LimitedRequestHandler:
            handler = self._factory()
            if not isinstance(handler, LimitedRequestHandler):  # it would never count itself out
                raise TypeError(f"a capped listener needs LimitedRequestHandler connections, not {handler!r}")
            handler.on_closed = slot.release
            return handler

        try:
            await self._loop.connect_accepted_socket(protocol, conn)
        except BaseException as exc:
            # No transport, or one closed already: the socket is ours to close and to count out.
            conn.close()
            slot.release()
            if not isinstance(exc, Exception):  # cancelled (the listener closed), or the process ends
                raise
            if isinstance(exc, OSError):  # the client left while its connection was set up
                log.debug("dropped an accepted connection: %s", exc)
            else:
                log.error("cannot serve an accepted connection", exc_info=exc)

    def _retried(self) -> None:
        self._retry = None
        self._resume()

    def _released(self) -> None:
        self.open -= 1
        if self.open < self.limit:
            self._resume()


async def bind(host: str, port: int, backlog: int) -> list[socket.socket]:
    """Listening sockets on every address of ``host`` (as asyncio's ``create_server`` binds them)."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # IPv4 has its own socket
            sock.bind(address)
            sock.listen(backlog)
            sock.setblocking(False)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


class CappedSite(web.TCPSite):
    """``web.TCPSite`` whose connections come through a :class:`CappedListener`: at most ``limit``
    sockets open at once. The runner's server must make :class:`LimitedRequestHandler` connections."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, *, limit: int,
                 backlog: int = 128) -> None:
        super().__init__(runner, host, port, backlog=backlog)
        self._limit = limit

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site (TCPSite's would listen through asyncio)
        server = self._runner.server
        assert server is not None
        sockets = await bind(self._host or "", self._port, self._backlog)
        self._server = CappedListener(sockets, server, self._limit)  # type: ignore[arg-type]
        self._bound_port = sockets[0].getsockname()[1]
