"""The floor of a gRPC hop in Python: a grpc.aio server whose Generate relays one engine's
stream and does nothing else (no routing, metrics, retries or accounting; the messages are
passed on as bytes, not even parsed).

`kvplane bench gateway` times it in the same rounds as the controller, in front of an engine
like the controller's, so the controller's own work is what the gateway adds beyond this
relay; the rest is what one more grpc.aio server and client call cost on the machine. It
runs on uvloop, like the controller. Run as
`python -m controller.relay_floor --target HOST:PORT --port-file FILE`.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import uvloop

from kvplane.channels import INSECURE
from kvplane.server import publish_port, serve_until_signal

SERVICE = "openengine.v1.OpenEngine"
SHUTDOWN_GRACE_S = 1.0


def _generate_handler(engine: grpc.aio.Channel) -> grpc.GenericRpcHandler:
    """Generate relayed as bytes both ways (not even parsed); a failed engine call ends the
    relayed call with the engine's status."""
    call_engine: grpc.aio.UnaryStreamMultiCallable[bytes, bytes] = engine.unary_stream(
        f"/{SERVICE}/Generate"
    )

    async def generate(
        request: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[bytes]:
        try:
            async for response in call_engine(request):
                yield response
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details() or "")

    return grpc.method_handlers_generic_handler(
        SERVICE, {"Generate": grpc.unary_stream_rpc_method_handler(generate)}
    )


@dataclass
class Relay:
    server: grpc.aio.Server
    port: int
    channel: grpc.aio.Channel

    async def close(self, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        await self.server.stop(grace_s)
        await self.channel.close()


async def start_relay(target: str) -> Relay:
    """A started relay to the engine at `target`, on a loopback port of the system's choosing."""
    channel = INSECURE.aio_channel(target)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([_generate_handler(channel)])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return Relay(server, port, channel)


async def run_relay(target: str, port_file: Path) -> None:
    relay = await start_relay(target)
    try:
        await publish_port(relay.server, port_file, relay.port)
        await serve_until_signal(relay.server, SHUTDOWN_GRACE_S)
    finally:
        await relay.channel.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="the engine, HOST:PORT")
    parser.add_argument("--port-file", type=Path, required=True)
    args = parser.parse_args()
    uvloop.run(run_relay(args.target, args.port_file))


if __name__ == "__main__":
    main()
