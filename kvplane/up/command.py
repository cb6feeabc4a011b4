"""The `kvplane up` command: start the fleet, then show it until Ctrl-C or run `--check`;
signals, a member's own exit, and stopping everything."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from kvplane.config import ClientTlsConfig
from kvplane.errors import KvplaneError
from kvplane.process_exit import exit_how, log_tail
from kvplane.up.config import FleetConfig
from kvplane.up.fleet import (
    WORKDIR_PREFIX,
    Fleet,
    Member,
    remove_stale_workdirs,
)
from kvplane.up.status import collect_status, render_status

log = logging.getLogger(__name__)

STATUS_INTERVAL_S = 1.0


async def run_fleet(config: FleetConfig, live: bool, check: bool = False) -> bool:
    """Run the fleet until Ctrl-C (or, with `check`, through the smoke test); returns False
    when the check failed or a member exited on its own (the rest are then stopped: a local
    fleet missing a member is broken). A Ctrl-C while the fleet stops (a second one, or one
    after a member's exit) kills every member at once.

    The members' configs and logs live in a private temporary folder, removed at the end,
    except after a failure (False or an error) once a member has started: then it is kept for
    its logs (the errors quote only their last lines), and its path is logged; the next
    `kvplane up` removes it. A check of a fleet without a controller is refused before any
    member starts."""
    if check and not any(m.kind == "controller" for m in config.members):
        raise KvplaneError("--check needs a controller in the fleet")
    remove_stale_workdirs(Path(tempfile.gettempdir()))
    workdir = Path(tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-"))
    ok = False
    try:
        ok = await _run_in(workdir, config, live, check)
        return ok
    finally:
        _remove_or_keep(workdir, failed=not ok)


def _remove_or_keep(workdir: Path, failed: bool) -> None:
    """Remove the fleet's folder, or keep it (and say where) for the logs of a failed run."""
    if failed and any(workdir.glob("*.log")):
        log.warning(
            "the members' configs and logs are kept in %s (the next kvplane up removes it)",
            workdir,
        )
    else:
        shutil.rmtree(workdir, ignore_errors=True)


async def _run_in(workdir: Path, config: FleetConfig, live: bool, check: bool) -> bool:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    fleet = Fleet(config, workdir)

    def on_signal(sig: signal.Signals) -> None:
        # Set by a first signal, and once the fleet stops for any reason (a member's exit,
        # the check's end): a signal then is one to stop now. Not a hangup: a terminal
        # closing sends two (the shell passes its own on to its jobs, then the kernel sends
        # the foreground job another as the shell exits), and the first one's drain must go
        # on.
        if stop.is_set() and sig == signal.SIGHUP:
            log.info("hung up while stopping: the stop goes on")
        elif stop.is_set():
            log.warning("interrupted while stopping: killing every member now")
            fleet.kill_all()
        stop.set()

    # SIGHUP too: the members run in sessions of their own, so a closed terminal reaches
    # only us, and we must stop them; unless we were started ignoring it:
    # `nohup kvplane up &` must outlive its terminal (a handler would stop the fleet).
    signals = [signal.SIGINT, signal.SIGTERM]
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signals.append(signal.SIGHUP)
    for sig in signals:
        loop.add_signal_handler(sig, on_signal, sig)
    main = asyncio.ensure_future(_main(fleet, stop, live, check))
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([main, stopper], return_when=asyncio.FIRST_COMPLETED)
        if not main.done():  # interrupted during start-up or the check
            main.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await main
            if check:  # the reason the check failed, or its error would point at nothing
                log.error("check failed: interrupted before it finished")
            return not check
        return main.result()
    finally:
        stopper.cancel()
        stop.set()  # stopping: a signal from now on kills every member
        if fleet.any_started():  # else the start's error is the one line printed
            log.info(
                "stopping the fleet: draining the controller and engines, each member stopped"
                " once its own drain ends"
            )
            await fleet.stop()
            log.info("fleet stopped")
        for sig in signals:
            loop.remove_signal_handler(sig)


async def _main(fleet: Fleet, stop: asyncio.Event, live: bool, check: bool) -> bool:
    await fleet.start()
    _announce(fleet)
    serving = asyncio.ensure_future(_serve(fleet, stop, live, check))
    exited = asyncio.ensure_future(fleet.first_exit())
    try:
        await asyncio.wait([serving, exited], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (serving, exited):
            task.cancel()
        await asyncio.gather(serving, exited, return_exceptions=True)
    if exited.done() and not exited.cancelled():
        _report_exit(exited.result())
        return False
    return serving.result()


async def _serve(fleet: Fleet, stop: asyncio.Event, live: bool, check: bool) -> bool:
    """Run the check (whether it passed), or show the fleet until stopped (True)."""
    if check:
        return await _check(fleet)
    await _show_until(fleet, stop, live)
    return True


def _report_exit(member: Member) -> None:
    process, log_path = member.process, member.log_path
    assert process is not None and process.returncode is not None and log_path is not None
    log.error(
        "%s exited unexpectedly with %s; its log %s ends: %s",
        member.name, exit_how(process.returncode), log_path, log_tail(log_path),
    )  # fmt: skip
    member.end_said = True  # not again by the stop


def _announce(fleet: Fleet) -> None:
    for m in fleet.members:
        log.info("fleet member %s (%s) on %s pid %s", m.name, m.kind, m.address or "-", m.pid)
        if m.metrics_address is not None:
            log.info("fleet member %s metrics on http://%s/metrics", m.name, m.metrics_address)


async def _check(fleet: Fleet) -> bool:
    from kvplane.up.check import check_fleet

    controller = next(m for m in fleet.members if m.kind == "controller")  # run_fleet checked
    assert controller.address is not None  # it is up
    problems = await check_fleet(controller.address, fleet.channels)
    for problem in problems:
        log.error("check failed: %s", problem)
    if not problems:
        log.info(
            "check passed: answers complete and the same from cache, repeated prefixes routed"
            " to their holders"
        )
    return not problems


def admin_tls_flags(tls: ClientTlsConfig | None) -> str:
    """The `kvplane admin` options that dial the fleet as up does (" --tls-ca F ...")."""
    if tls is None:
        return ""
    flags = [
        ("--tls-ca", tls.ca_file),
        ("--tls-cert", tls.cert_file),
        ("--tls-key", tls.key_file),
        ("--tls-server-name", tls.server_name),
    ]
    return "".join(f" {flag} {value}" for flag, value in flags if value is not None)


async def _show_until(fleet: Fleet, stop: asyncio.Event, live: bool) -> None:
    if not live or not os.isatty(sys.stdout.fileno()):
        await stop.wait()
        return
    from rich.console import Console
    from rich.live import Live

    console = Console()
    for m in fleet.members:
        if m.kind == "controller":
            console.print(
                f"controller on {m.address}: send OpenEngine requests there; "
                f"`kvplane admin --target {m.address}{admin_tls_flags(fleet.config.client_tls)}"
                " workers` shows the fleet",
                highlight=False,
            )
    with Live(render_status(await collect_status(fleet)), console=console) as view:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(STATUS_INTERVAL_S):
                    await stop.wait()
            await fleet.refresh()
            view.update(render_status(await collect_status(fleet)))
