"""The options of the channels every kvplane client opens (`kvplane.channels`).

How soon a channel reconnects to a peer back after an outage is not tested for real: gRPC's
own backoff passes the 5 s bound only after about ten seconds down, and the difference shows
only as a duration, which a test would have to time."""

from __future__ import annotations

from kvplane.channels import INSECURE, MAX_RECONNECT_BACKOFF_MS, ClientChannels, plain_details
from kvplane.config import ClientTlsConfig

BACKOFF = "grpc.max_reconnect_backoff_ms"


def test_every_client_channel_bounds_its_reconnect_backoff() -> None:
    """Insecure or TLS, with a token or not: the planner's, a bridge's, a decode engine's
    channels retry a lost peer at least every 5 s, not gRPC's 120 s, and ping a connection
    with calls under way every 5 minutes (as often as a server with gRPC's defaults takes),
    waiting 20 s for the answer (not gRPC's 60 s for any ping)."""
    tls = ClientChannels.load(ClientTlsConfig(server_name="engine-0"))
    for channels in (INSECURE, ClientChannels.load(None), tls, INSECURE.with_metadata(())):
        options = dict(channels.options)
        assert options[BACKOFF] == MAX_RECONNECT_BACKOFF_MS == 5000
        assert options["grpc.keepalive_time_ms"] == 300_000
        assert options["grpc.keepalive_timeout_ms"] == options["grpc.http2.ping_timeout_ms"]
        assert options["grpc.http2.ping_timeout_ms"] == 20_000
    assert dict(tls.options)["grpc.ssl_target_name_override"] == "engine-0"


def test_a_clients_own_options_replace_the_defaults_and_the_earlier_ones() -> None:
    """`reconnecting` (the controller's health backoff) sets the bound, `keeping_alive` the
    pings (its `health.keepalive_s`); set twice, the last wins; every option is given once
    (which of two duplicates gRPC takes is not said)."""
    channels = (
        INSECURE.reconnecting(0.25, 3.0)
        .receiving_any_size()
        .reconnecting(0.5, 30.0)
        .keeping_alive(10.0, 2.5)
        .with_options(("grpc.max_receive_message_length", 1 << 24))
    )
    names = [name for name, _ in channels.options]
    assert len(names) == len(set(names)), names
    assert dict(channels.options) == {
        BACKOFF: 30_000,
        "grpc.initial_reconnect_backoff_ms": 500,
        "grpc.max_receive_message_length": 1 << 24,
        "grpc.keepalive_time_ms": 10_000,
        "grpc.keepalive_timeout_ms": 2_500,
        "grpc.http2.ping_timeout_ms": 2_500,
        "grpc.http2.max_pings_without_data": 0,
    }


def test_a_host_that_does_not_resolve_is_said_so_whichever_resolver_said_it() -> None:
    """gRPC's own resolver and c-ares (GRPC_DNS_RESOLVER=ares on some builds) word it
    differently, each at length; both become one short reason."""
    said_by = (
        "errors resolving nope.invalid:8100: [field:hostname lookup error:address lookup failed "
        "for nope.invalid:8100: Domain name not found]",
        "DNS resolution failed for nope.invalid:8100: C-ares status is not ARES_SUCCESS "
        "qtype=A name=nope.invalid is_balancer=0: Domain name not found",
    )
    for details in said_by:
        assert plain_details(details) == "the host does not resolve (Domain name not found)"
