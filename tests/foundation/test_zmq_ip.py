"""Which ZMQ endpoints get libzmq's IPv6 option (`kvplane.zmq_ip`); the sockets themselves are
exercised end to end in tests/engine/test_server_kv_events.py and tests/indexer/test_bridge.py."""

from __future__ import annotations

import pytest
import zmq

from kvplane.zmq_ip import endpoint_needs_ipv6, set_ip_version


@pytest.mark.parametrize(
    ("endpoint", "needs_ipv6"),
    [
        ("tcp://[::1]:5557", True),
        ("tcp://[fe80::1%eth0]:5557", True),
        ("tcp://[::]:*", True),
        ("tcp://::1:5557", True),  # libzmq reads the last colon as the port's
        ("tcp://*:5557", True),  # dual stack
        ("tcp://0.0.0.0:5557", False),  # the IPv4 wildcard stays IPv4
        ("tcp://127.0.0.1:5557", False),
        # A name stays IPv4: with IPv6 on, libzmq would pick its IPv6 address first.
        ("tcp://localhost:5557", False),
        ("tcp://engine-0.example:5557", False),
        ("ipc:///tmp/kv[::1]", False),
        ("inproc://kv", False),
    ],
)
def test_ipv6_addresses_and_the_bind_wildcard_get_ipv6(endpoint: str, needs_ipv6: bool) -> None:
    assert endpoint_needs_ipv6(endpoint) is needs_ipv6
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    try:
        sock.setsockopt(zmq.IPV6, int(not needs_ipv6))  # set_ip_version overrides either way
        set_ip_version(sock, endpoint)
        assert sock.getsockopt(zmq.IPV6) == int(needs_ipv6)
    finally:
        sock.close(linger=0)
        ctx.term()
