"""What a process that `kvplane up` starts does first: die with `up`, keep to its CPUs; and
how long `up` gives it to stop (`stop_within_s`: its `stop_timeout_s`, `STOP_TIMEOUT_S` by
default), which a member that stops others (the planner, its engines) fits its own stop in.

`up` says these through the environment (`member_environment`), and the member acts on them
as the CLI starts (`join_fleet`), before it starts a thread or loads torch. They are not done
in the forked child before exec (a `preexec_fn`): a fork that runs Python code also runs
gRPC's fork handlers, and while `up`'s own channels poll the members those are skipped,
which can leave the child a broken copy of gRPC's state (one member's start-up once died in
gRPC's epoll poller, "Bad file descriptor", right after `up` logged that it skipped them).
Without a `preexec_fn` CPython spawns with vfork and no fork handler runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Mapping

PARENT_ENV = "KVPLANE_UP_PARENT"  # the pid of `up`: the member dies with it
CPUS_ENV = "KVPLANE_UP_CPUS"  # comma-separated CPUs the member keeps to
STOP_WITHIN_ENV = "KVPLANE_UP_STOP_WITHIN_S"  # seconds the member has to stop after SIGTERM
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# Seconds `up` gives a member to stop after its SIGTERM (`stop_timeout_s`'s default); then it
# kills the member with its process group.
STOP_TIMEOUT_S = 15.0


def member_environment(
    cpus: list[int] | None, stop_within_s: float = STOP_TIMEOUT_S
) -> dict[str, str]:
    """The variables `up` adds to a member's environment."""
    env = {PARENT_ENV: str(os.getpid()), STOP_WITHIN_ENV: repr(stop_within_s)}
    if cpus is not None:
        env[CPUS_ENV] = ",".join(str(cpu) for cpu in cpus)
    return env


# The variables `up` told this member that it reads later, kept by `join_fleet` as it drops them.
_told: dict[str, str] = {}


def stop_within_s(environ: Mapping[str, str]) -> float:
    """How long this process has to stop after its SIGTERM before it is killed: what `up`
    said (its `stop_timeout_s`: in `environ`, or as `join_fleet` found it), else
    `STOP_TIMEOUT_S` (not a member, or `up` said nothing usable). The member's own children
    do not inherit it; those given `member_environment` are told their own."""
    with contextlib.suppress(KeyError, ValueError):
        within_s = float({**_told, **environ}[STOP_WITHIN_ENV])
        if within_s > 0:
            return within_s
    return STOP_TIMEOUT_S


def cpus_missing(cpus: list[int]) -> str | None:
    """Why a member cannot keep to `cpus` on this machine (some are not among this process's
    CPUs, which its children inherit), or None when it can."""
    available = os.sched_getaffinity(0)
    missing = sorted(set(cpus) - available)
    if not missing:
        return None
    return f"{missing} are not among this process's CPUs {sorted(available)}"


def join_fleet() -> None:
    """Act on `member_environment`'s variables, if this process has them, and drop them so
    that the member's own children do not act on them too."""
    parent = os.environ.pop(PARENT_ENV, None)
    cpus = os.environ.pop(CPUS_ENV, None)
    if STOP_WITHIN_ENV in os.environ:
        _told[STOP_WITHIN_ENV] = os.environ.pop(STOP_WITHIN_ENV)
    if cpus:
        os.sched_setaffinity(0, {int(cpu) for cpu in cpus.split(",")})
    if parent and sys.platform.startswith("linux"):
        # The members lead sessions of their own (Ctrl-C reaches only `up`), so without this
        # a SIGKILLed `up` would leave the fleet running. The kernel sends SIGTERM when the
        # thread that started this process ends: `up`'s event loop, which runs until the
        # fleet stops.
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != int(parent):  # `up` died before the prctl
            os._exit(1)
