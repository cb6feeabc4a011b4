"""IPv6 loopback for the tests that need it: they skip only on a machine without one (no
IPv6 in Python or the kernel, or ::1 not configured), never because of kvplane."""

from __future__ import annotations

import socket

import pytest


def has_ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


needs_ipv6_loopback = pytest.mark.skipif(
    not has_ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)"
)
