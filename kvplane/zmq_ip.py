"""Which IP version a ZMQ TCP endpoint needs: libzmq's `IPV6` socket option, set per endpoint.

A libzmq socket is IPv4-only until `zmq.IPV6` is set on it: binding an IPv6 address then fails
(ENODEV) and connecting to one never succeeds (libzmq retries, silently, forever). The rule,
shared by the engine's publisher and the indexer's sources:

- an IPv6 address (`tcp://[::1]:5557`, `tcp://[fe80::1%eth0]:5557`): IPv6 on;
- `*` (binding): IPv6 on, so the socket listens dual stack: libzmq binds `[::]` and accepts
  IPv4 peers through mapped addresses (and binds IPv4 alone where the kernel has no IPv6).
  vLLM's publisher sets no IPv6, so its `*` is IPv4 only; ours also answers an engine
  advertised at an IPv6 address, as pods of an IPv6 cluster are. `[::]` is dual stack too;
  `0.0.0.0` stays IPv4 only;
- anything else (an IPv4 address, a host name): IPv6 off. With it on, libzmq would resolve a
  name to its IPv6 address first, and a name with both (often `localhost`) would then miss a
  publisher listening on IPv4 only, vLLM's default among them. So a name reaches IPv4 only:
  give an IPv6-only host by its address, in brackets.

Not TCP (ipc, inproc): IPv6 off, and libzmq ignores it.
"""

from __future__ import annotations

from typing import Any

import zmq


def endpoint_needs_ipv6(endpoint: str) -> bool:
    """Whether `endpoint` is TCP on an IPv6 address or on `*` (see the module docstring)."""
    transport, _, address = endpoint.partition("://")
    if transport != "tcp":
        return False
    host = address.rpartition(":")[0]
    return host == "*" or ":" in host  # an IPv6 address (bracketed or not) has colons


def is_ipv4_wildcard(endpoint: str) -> bool:
    """Whether `endpoint` is TCP on 0.0.0.0: every IPv4 address of the machine and no IPv6
    one, so it must be advertised at an IPv4 address (or a name, which a ZMQ client resolves
    to IPv4)."""
    transport, _, address = endpoint.partition("://")
    return transport == "tcp" and address.rpartition(":")[0] == "0.0.0.0"


def set_ip_version(sock: zmq.Socket[Any], endpoint: str) -> None:
    """Set `sock`'s IPv6 option as `endpoint` needs: call before binding or connecting it."""
    sock.setsockopt(zmq.IPV6, int(endpoint_needs_ipv6(endpoint)))
