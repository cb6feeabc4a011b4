"""A TCP forwarder on loopback (real sockets) that a test can cut, to put one process, and
only it, behind a network partition from an engine: the process reaches the engine through
it (a ZMQ endpoint given as the forwarder's, or gRPC's `grpc_proxy` environment variable
naming it as an HTTP CONNECT proxy), its other connections (Redis) and other processes'
direct routes stay up, and `cut()` drops its connections and refuses new ones, as a
partition between the two would (`mend()` ends it). `lose_next_reply` drops one connection
between a request and its reply: the server ran the request, the client never learns whether
it did. `silence` makes connections go silent without a reset (a blackholed path),
`slow_down` makes them late (a congested link)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable


class TcpForwarder:
    """To `to` (`host:port`, or a ZMQ `tcp://host:port`), or, without one, an HTTP CONNECT
    proxy to whatever each connection asks."""

    def __init__(self, to: str | None) -> None:
        self._to = to.removeprefix("tcp://") if to is not None else None
        self._server: asyncio.Server | None = None
        self._port = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self._serving: set[asyncio.Task[None]] = set()  # one per connection
        self.tunnels = 0  # connections forwarded so far
        self.bytes_from_clients = 0  # what the clients sent through it so far
        # `lose_next_reply` / `lose_next_request`: the marker, whether the request still
        # reaches the server, how many more requests to lose, and the event set once lost.
        self._doomed_by: bytes | None = None
        self._doomed_after_server = True
        self._doomed_times = 0
        self._lost = asyncio.Event()
        # `silence`: the connections up to this one (in `tunnels` order) forward nothing, nor,
        # with `new_ones`, those opened until `let_new_ones_through`.
        self._silenced_up_to = 0
        self._silencing_new = False
        # `slow_down`: the connections up to this one forward what they read this late.
        self._slowed_up_to = 0
        self._latency_s = 0.0
        # `hold_requests`: the marker of the requests held, set once one is, and the event
        # that lets them through.
        self._held_by: bytes | None = None
        self.held = asyncio.Event()
        self._let_through = asyncio.Event()

    @classmethod
    async def start(cls, to: str | None = None) -> TcpForwarder:
        forwarder = cls(to)
        forwarder._server = await asyncio.start_server(forwarder._serve, "127.0.0.1", 0)
        forwarder._port = forwarder._server.sockets[0].getsockname()[1]
        return forwarder

    @property
    def url(self) -> str:
        """As an HTTP proxy (`grpc_proxy`)."""
        return f"http://127.0.0.1:{self._port}"

    @property
    def address(self) -> str:
        """As a gRPC target (`host:port`)."""
        return f"127.0.0.1:{self._port}"

    @property
    def endpoint(self) -> str:
        """As a ZMQ endpoint."""
        return f"tcp://127.0.0.1:{self._port}"

    def lose_next_reply(self, marker: bytes) -> asyncio.Event:
        """The next request holding `marker` reaches the server, but its connection drops as
        the reply comes back, the reply not forwarded. Returns the event set once it has."""
        return self._lose(marker, after_server=True, times=1)

    def lose_next_request(self, marker: bytes, times: int = 1) -> asyncio.Event:
        """The next `times` requests holding `marker` never reach the server: each one's
        connection drops instead. Returns the event set once the last has."""
        return self._lose(marker, after_server=False, times=times)

    def _lose(self, marker: bytes, after_server: bool, times: int) -> asyncio.Event:
        self._doomed_by, self._doomed_after_server, self._doomed_times = marker, after_server, times
        self._lost = asyncio.Event()
        return self._lost

    def _dooms(self, data: bytes) -> bool:
        """Whether `data` is a request to lose (or whose reply to lose)."""
        if self._doomed_by is None or self._doomed_by not in data:
            return False
        self._doomed_times -= 1
        if self._doomed_times == 0:
            self._doomed_by = None
        return True

    def hold_requests(self, marker: bytes) -> None:
        """Requests holding `marker` (and what their connection sends after them) wait until
        `let_through`, as for a server slow to answer them; `held` is set once one does."""
        self._held_by = marker
        self.held.clear()
        self._let_through.clear()

    def let_through(self) -> None:
        """The requests `hold_requests` held go on, and the next ones are not held."""
        self._held_by = None
        self._let_through.set()

    async def _hold(self, data: bytes) -> None:
        if self._held_by is not None and self._held_by in data:
            self.held.set()
            await self._let_through.wait()

    async def cut(self) -> None:
        """Refuse new connections and drop every one open."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()
        # (Ended here, not cancelled with the event loop, which asyncio logs as an error.)
        await asyncio.gather(*self._serving, return_exceptions=True)

    def silence(self, new_ones: bool = False) -> None:
        """The connections open now go silent, both ways, and stay open: a peer gone without
        a reset (its host vanished, a NAT entry expired). New connections are forwarded as
        ever; with `new_ones`, they go silent too (accepted, nothing forwarded: a blackholed
        path), until `let_new_ones_through`."""
        self._silenced_up_to = self.tunnels
        self._silencing_new = new_ones

    def let_new_ones_through(self) -> None:
        """After `silence(new_ones=True)`: the connections opened from now on are forwarded
        (the path healed); those opened silent stay so."""
        self._silencing_new = False

    def slow_down(self, latency_s: float) -> None:
        """The connections open now deliver what they read `latency_s` late, both ways, in
        order, reading on meanwhile: a congested link (a full buffer somewhere on the path),
        slow but losing nothing. New connections are forwarded as ever."""
        self._slowed_up_to, self._latency_s = self.tunnels, latency_s

    async def mend(self) -> None:
        """After `cut`: accept connections again, on the same port."""
        if self._server is None:
            self._server = await asyncio.start_server(self._serve, "127.0.0.1", self._port)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._serving.add(task)
        task.add_done_callback(self._serving.discard)
        self._writers.add(writer)
        up_writer: asyncio.StreamWriter | None = None
        try:
            target = self._to
            if target is None:
                head = await reader.readuntil(b"\r\n\r\n")
                method, asked, _ = head.split(b"\r\n", 1)[0].split(b" ", 2)
                if method != b"CONNECT":
                    writer.write(b"HTTP/1.1 405 Method Not Allowed\r\n\r\n")
                    return
                target = asked.decode()
            host, _, port = target.rpartition(":")
            up_reader, up_writer = await asyncio.open_connection(host.strip("[]"), int(port))
            self._writers.add(up_writer)
            self.tunnels += 1
            tunnel = self.tunnels
            born_silent = self._silencing_new
            if self._to is None:
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            doomed = False  # this connection's reply is to be lost

            def silent() -> bool:
                return born_silent or tunnel <= self._silenced_up_to

            def latency() -> float:
                return self._latency_s if tunnel <= self._slowed_up_to else 0.0

            def request(data: bytes) -> bool:
                nonlocal doomed
                self.bytes_from_clients += len(data)
                after_server = self._doomed_after_server
                if not self._dooms(data):
                    return True
                if self._doomed_by is None:
                    self._lost.set()
                doomed = after_server
                return after_server

            def reply(data: bytes) -> bool:
                return not doomed

            await asyncio.gather(
                _pipe(reader, up_writer, request, silent, hold=self._hold, latency=latency),
                _pipe(up_reader, writer, reply, silent, latency=latency),
            )
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            for end in (writer, up_writer):
                if end is not None:
                    self._writers.discard(end)
                    end.transport.abort()


async def _pipe(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    forwards: Callable[[bytes], bool] = lambda data: True,
    silent: Callable[[], bool] = lambda: False,
    *,
    hold: Callable[[bytes], Awaitable[None]] | None = None,
    latency: Callable[[], float] = lambda: 0.0,
) -> None:
    """Copies `reader` to `writer` until either ends, or until `forwards` refuses a chunk;
    while `silent()`, what is read is dropped instead, and `reader`'s end is not passed on
    (a blackholed path carries no FIN nor reset: the connection ends with the other way).
    `hold(chunk)`: awaited before a chunk goes on. Once `latency()` is above 0, each chunk
    goes on that late (and every later one in order after it), the reading going on
    meanwhile."""
    loop = asyncio.get_running_loop()
    late: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
    delivering: asyncio.Task[None] | None = None

    async def deliver_late() -> None:
        with contextlib.suppress(OSError):
            while (item := await late.get()) is not None:
                due, data = item
                await asyncio.sleep(due - loop.time())
                writer.write(data)
                await writer.drain()

    try:
        while (data := await reader.read(65536)) and forwards(data):
            if silent():
                continue
            if hold is not None:
                await hold(data)
            if delivering is not None or latency() > 0:
                if delivering is None:
                    delivering = asyncio.create_task(deliver_late())
                late.put_nowait((loop.time() + latency(), data))
                continue
            writer.write(data)
            await writer.drain()
        if delivering is not None:
            late.put_nowait(None)
            await delivering
    except OSError:
        pass
    finally:
        if delivering is not None:
            delivering.cancel()
        # A silent connection's end is not passed on either: the peer learns nothing of it.
        if not silent():
            with contextlib.suppress(OSError):
                writer.transport.abort()
