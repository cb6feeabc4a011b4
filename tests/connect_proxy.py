"""An HTTP CONNECT proxy on loopback (real sockets) that a test can cut: a process told to
reach its engines through it (gRPC's `grpc_proxy` environment variable) loses them, and only
them, when it is cut, as a network partition between that process and its engines would,
while its other connections (Redis) and other processes' direct routes stay up."""

from __future__ import annotations

import asyncio
import contextlib


class ConnectProxy:
    def __init__(self) -> None:
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.tunnels = 0  # connections tunnelled so far

    @classmethod
    async def start(cls) -> ConnectProxy:
        proxy = cls()
        proxy._server = await asyncio.start_server(proxy._serve, "127.0.0.1", 0)
        return proxy

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def cut(self) -> None:
        """Refuse new connections and drop every tunnel open."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        up_writer: asyncio.StreamWriter | None = None
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            method, target, _ = head.split(b"\r\n", 1)[0].split(b" ", 2)
            if method != b"CONNECT":
                writer.write(b"HTTP/1.1 405 Method Not Allowed\r\n\r\n")
                return
            host, _, port = target.decode().rpartition(":")
            up_reader, up_writer = await asyncio.open_connection(host.strip("[]"), int(port))
            self._writers.add(up_writer)
            self.tunnels += 1
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        except (OSError, asyncio.IncompleteReadError, ValueError):
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
