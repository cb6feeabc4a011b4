"""A TCP forwarder on loopback (real sockets) that a test can cut, to put one process, and
only it, behind a network partition from an engine: the process reaches the engine through
it (a ZMQ endpoint given as the forwarder's, or gRPC's `grpc_proxy` environment variable
naming it as an HTTP CONNECT proxy), its other connections (Redis) and other processes'
direct routes stay up, and `cut()` drops its connections and refuses new ones, as a
partition between the two would."""

from __future__ import annotations

import asyncio
import contextlib


class TcpForwarder:
    """To `to` (`host:port`, or a ZMQ `tcp://host:port`), or, without one, an HTTP CONNECT
    proxy to whatever each connection asks."""

    def __init__(self, to: str | None) -> None:
        self._to = to.removeprefix("tcp://") if to is not None else None
        self._server: asyncio.Server | None = None
        self._port = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self.tunnels = 0  # connections forwarded so far

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
    def endpoint(self) -> str:
        """As a ZMQ endpoint."""
        return f"tcp://127.0.0.1:{self._port}"

    async def cut(self) -> None:
        """Refuse new connections and drop every one open."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
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
            if self._to is None:
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            for end in (writer, up_writer):
                if end is not None:
                    self._writers.discard(end)
                    end.transport.abort()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            writer.transport.abort()
