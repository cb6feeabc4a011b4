"""A `kvplane up` fleet with a planner member: the planner's engines count as the fleet's
(up waits for its pools' minimum, the status shows them, --check routes to them), and
stopping stops the planner first, which takes its engines along, leaving no process."""

from __future__ import annotations

import contextlib
import os
import re
import signal
from pathlib import Path

import pytest
import yaml

from kvplane.errors import ConfigError
from kvplane.up.config import FleetConfig, load_fleet
from kvplane.up.fleet import WORKDIR_PREFIX, Fleet
from kvplane.up.status import collect_status
from tests.foundation.test_up import MEMBER_LINE, REPO, _kill_leftovers, _up, _up_check
from tests.processes import running, wait_gone


def _children(pid: int) -> list[int]:
    """The processes `pid` started (its planner engines), from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:  # it ended meanwhile
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _naming(folder: Path) -> list[int]:
    """Running processes whose command line names `folder` (members and their children)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(folder) in text and running(int(cmdline.parent.name)):
            pids.append(int(cmdline.parent.name))
    return pids


PLANNER_FLEET = {
    "members": [
        {"name": "controller", "kind": "controller"},
        {
            "name": "planner",
            "kind": "planner",
            "config": {
                "pools": [{"name": "default", "min_engines": 2, "max_engines": 3}],
                "scaling": {"tick_s": 1},
            },
        },
    ]
}
ONE_ENGINE_PLANNER = {
    "name": "planner",
    "kind": "planner",
    "config": {"pools": [{"name": "default", "min_engines": 1, "max_engines": 1}]},
}


@pytest.mark.timeout(90)
async def test_the_planners_engines_are_the_fleets_until_the_planner_stops_first(
    tmp_path: Path,
) -> None:
    fleet = Fleet(FleetConfig.model_validate(PLANNER_FLEET), tmp_path)
    planner = fleet.member("planner")
    engines: list[int] = []
    try:
        await fleet.start()
        # Started means the pool's minimum is routed to: both engines, in the live status.
        status = await collect_status(fleet)
        assert [e.state for e in status.engines] == ["ready", "ready"]
        assert all(e.total_kv_blocks for e in status.engines)
        assert ("planner", "planner", "-", planner.pid, "running") in status.members
        assert planner.pid is not None
        engines = _children(planner.pid)
        assert len(engines) == 2
        # Their logs are kept with the members' (up's folder).
        assert len(list((tmp_path / "planner-engines").glob("default-*.log"))) == 2

        await fleet.stop_planners()
        assert planner.state == "stopped (0)"
        assert wait_gone(engines, 0) == []  # the planner stopped them before it exited
        # It took them out of the controller, which was still up: no stale engine is left.
        after = await collect_status(fleet)
        assert after.engines == []
        assert fleet.member("controller").state == "serving"
    finally:
        await fleet.stop()  # drains first
        assert wait_gone(engines, 10) == []


@pytest.mark.timeout(90)
async def test_a_planner_whose_engine_hangs_stops_within_up_s_grace(tmp_path: Path) -> None:
    """A planner's engine hung (SIGSTOPped: it answers no drain and holds SIGTERM pending)
    when up stops the planner: up tells the planner its `stop_timeout_s` (here not the
    default), and the planner kills the engine itself (it says so) and exits on its own,
    seconds before up would kill it. Before, the planner took 13 s whatever up's
    `stop_timeout_s`, so up killed it (-9) and the engine, in a session of its own, was left
    stopped with only its parent-death SIGTERM pending."""
    config = {
        **PLANNER_FLEET,
        "members": [PLANNER_FLEET["members"][0], ONE_ENGINE_PLANNER],
        "stop_timeout_s": 12.0,
    }
    fleet = Fleet(FleetConfig.model_validate(config), tmp_path)
    planner = fleet.member("planner")
    engines: list[int] = []
    try:
        await fleet.start()
        assert planner.pid is not None and planner.log_path is not None
        (engine,) = engines = _children(planner.pid)
        os.kill(engine, signal.SIGSTOP)
        await fleet.stop_planners()
        log = planner.log_path.read_text()
        assert f"engine process(es) {engine} still running at the close's end" in log, log
        assert planner.state == "stopped (0)", log  # not killed by up
        assert wait_gone(engines, 0) == []  # the planner killed it before it exited
    finally:
        for pid in engines:  # let a stopped one take its SIGTERM
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        await fleet.stop()
        assert wait_gone(engines, 10) == []


@pytest.mark.timeout(90)
def test_up_check_passes_on_the_shipped_planner_fleet_and_leaves_no_process(
    tmp_path: Path,
) -> None:
    """configs/local-planner.yaml: a fixed engine and a planner keeping one more; --check runs
    once the planner's engine is routed to, and the planner's engines, which are not members,
    are stopped too (every process naming up's folder, under TMPDIR=tmp_path, is gone)."""
    config = yaml.safe_load((REPO / "configs" / "local-planner.yaml").read_text())
    config["members"][1]["config"]["listen"] = "127.0.0.1:0"
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump(config))
    result = _up_check(fleet, tmp_path, timeout_s=80)
    assert result.returncode == 0, result.stderr
    assert "planner running with its pools' minimum of engines routed to" in result.stderr
    assert "check passed" in result.stderr
    log = result.stderr
    assert log.index("stopping planner first") < log.index("fleet stopped")
    kinds = {m.group(1): m.group(2) for m in MEMBER_LINE.finditer(log)}
    assert kinds == {"engine-0": "engine", "controller": "controller", "planner": "planner"}
    assert _naming(tmp_path) == []
    assert list(tmp_path.glob(f"{WORKDIR_PREFIX}*")) == []


def _fleet_file(tmp_path: Path, members: str, pki: Path | None = None) -> Path:
    """A fleet file of `members`, where `{pki}` is the test CA's folder and `{token}` a token
    file (up reads the members' files before it starts any)."""
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    fleet = tmp_path / "fleet.yaml"
    text = members.replace("{token}", str(token))
    fleet.write_text("members:\n" + (text if pki is None else text.replace("{pki}", str(pki))))
    return fleet


def test_a_planner_is_registered_with_the_fleets_controller_by_default(tmp_path: Path) -> None:
    fleet = _fleet_file(
        tmp_path,
        "  - {name: ctl, kind: controller}\n"
        "  - {name: p, kind: planner, config: {live: {engine_args: [--model, sim]}}}\n"
        "  - {name: q, kind: planner, config: {live: {controller: '127.0.0.1:9'}}}\n",
    )
    members = {m.name: m for m in load_fleet(fleet).members}
    given = {"controller": "${ctl}", "engine_args": ["--model", "sim"]}
    assert members["p"].config["live"] == given
    assert members["p"].refers_to() == {"ctl"}  # started after it, stopped before it
    assert members["q"].config["live"] == {"controller": "127.0.0.1:9"}  # as given


def test_a_planner_with_controller_tls_may_name_a_tls_controller(tmp_path: Path, pki: Path) -> None:
    fleet = _fleet_file(
        tmp_path,
        "  - {name: ctl, kind: controller, config: {tls: {cert_file: {pki}/server.pem, "
        "key_file: {pki}/server.key}}}\n"
        "  - {name: p, kind: planner, config: {live: {controller_tls: {ca_file: {pki}/ca.pem}}}}\n",
        pki,
    )
    (_, planner) = load_fleet(fleet).members
    assert planner.config["live"]["controller_tls"] == {"ca_file": f"{pki}/ca.pem"}


def test_a_planner_with_controller_token_file_may_name_a_controller_with_auth(
    tmp_path: Path, pki: Path
) -> None:
    fleet = _fleet_file(
        tmp_path,
        "  - {name: ctl, kind: controller, config: {auth: {token_file: {token}}}}\n"
        "  - {name: p, kind: planner, config: {live: {controller_token_file: {token}}}}\n"
        "  - {name: secure, kind: controller, config: {tls: {cert_file: {pki}/server.pem, "
        "key_file: {pki}/server.key}, auth: {token_file: {token}}}}\n"
        "  - {name: q, kind: planner, config: {live: {controller: '${secure}', "
        "controller_tls: {ca_file: {pki}/ca.pem}, controller_token_file: {token}}}}\n",
        pki,
    )
    members = {m.name: m for m in load_fleet(fleet).members}
    assert members["p"].config["live"]["controller_token_file"] == str(tmp_path / "token")
    assert members["q"].refers_to() == {"secure"}


@pytest.mark.timeout(90)
def test_up_check_runs_a_planner_against_a_controller_with_auth(tmp_path: Path) -> None:
    """A controller asking for the token on every call (`protect_reads`): the planner
    registers its engine with `live.controller_token_file`, up sees it routed to (with
    `client_token_file`) and --check passes; the planner takes its engine out at the end."""
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    config = {
        "client_token_file": str(token),
        "members": [
            {
                "name": "controller",
                "kind": "controller",
                "config": {
                    "listen": "127.0.0.1:0",
                    "auth": {"token_file": str(token), "protect_reads": True},
                },
            },
            {
                "name": "planner",
                "kind": "planner",
                "config": {
                    "pools": [{"name": "default", "min_engines": 1, "max_engines": 1}],
                    "scaling": {"tick_s": 0.5},
                    "live": {"controller_token_file": str(token)},
                },
            },
        ],
    }
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump(config))
    result = _up_check(fleet, tmp_path, timeout_s=80)
    assert result.returncode == 0, result.stderr
    assert "planner running with its pools' minimum of engines routed to" in result.stderr
    assert "check passed" in result.stderr
    assert "UNAUTHENTICATED" not in result.stderr
    assert _naming(tmp_path) == []


def test_a_planner_of_kubernetes_deployments_is_a_valid_member(tmp_path: Path) -> None:
    """Its engines are a Deployment's pods: up gives it no `live.workdir` (which the planner
    refuses beside `kubernetes`), yet still the fleet's controller."""
    kubernetes = (
        "{api_server: 'http://127.0.0.1:8001', namespace: serving, token_file: null,"
        " deployments: {default: kvplane-engine}}"
    )
    fleet = _fleet_file(
        tmp_path,
        "  - {name: ctl, kind: controller}\n"
        f"  - {{name: p, kind: planner, config: {{live: {{kubernetes: {kubernetes}}}}}}}\n",
    )
    (_, planner) = load_fleet(fleet).members
    config = planner.server_config({"ctl": "127.0.0.1:8100"}, tmp_path)
    assert config["live"]["controller"] == "127.0.0.1:8100" and "workdir" not in config["live"]


@pytest.mark.parametrize(
    ("members", "problem"),
    [
        (
            "  - {name: ctl, kind: controller}\n"
            "  - {name: p, kind: planner, config: {pools: [{min_engines: 3, max_engines: 2}]}}\n",
            "member p: pools.0: pool 'default': max_engines (2) is below min_engines (3)",
        ),
        # A planner listens nowhere: no `listen` is added to its config, nor taken.
        (
            "  - {name: ctl, kind: controller}\n"
            "  - {name: p, kind: planner, config: {listen: '127.0.0.1:0'}}\n",
            "member p: listen: Extra inputs are not permitted",
        ),
        (
            "  - {name: p, kind: planner}\n  - {name: ctl, kind: controller}\n",
            "member 'p': no controller listed before it, so live.controller",
        ),
        (
            "  - {name: c1, kind: controller}\n  - {name: c2, kind: controller}\n"
            "  - {name: p, kind: planner}\n",
            "member 'p': controllers c1, c2 listed before it, so live.controller",
        ),
        (
            "  - {name: ctl, kind: controller, config: {auth: {token_file: {token}}}}\n"
            "  - {name: p, kind: planner}\n",
            "member p: the planner dials its controller without a token (give it "
            "live.controller_token_file), and controller ctl has `auth`",
        ),
        # Each of the controller's demands needs its own setting: TLS is not a token...
        (
            "  - {name: ctl, kind: controller, config: {tls: {cert_file: {pki}/server.pem, "
            "key_file: {pki}/server.key}, auth: {token_file: {token}}}}\n"
            "  - {name: p, kind: planner, config: {live: {controller_tls: "
            "{ca_file: {pki}/ca.pem}}}}\n",
            "member p: the planner dials its controller without a token (give it "
            "live.controller_token_file), and controller ctl has `auth`",
        ),
        # ...nor a token TLS.
        (
            "  - {name: ctl, kind: controller, config: {tls: {cert_file: {pki}/server.pem, "
            "key_file: {pki}/server.key}, auth: {token_file: {token}}}}\n"
            "  - {name: p, kind: planner, config: {live: {controller_token_file: {token}}}}\n",
            "member p: the planner dials its controller without TLS (give it "
            "live.controller_tls), and controller ctl has `tls`",
        ),
        (
            "  - {name: ctl, kind: controller, config: {tls: {cert_file: {pki}/server.pem, "
            "key_file: {pki}/server.key}}}\n"
            "  - {name: p, kind: planner}\n",
            "member p: the planner dials its controller without TLS (give it "
            "live.controller_tls), and controller ctl has `tls`",
        ),
        # Up would count one planner's engines as the other's: one planner takes every pool.
        (
            "  - {name: ctl, kind: controller}\n"
            "  - {name: p, kind: planner, config: {pools: [{name: a}]}}\n"
            "  - {name: q, kind: planner, config: {pools: [{name: b}]}}\n",
            "planners p and q both use controller ctl: give one planner all the pools",
        ),
    ],
    ids=[
        "bad-pool",
        "listen",
        "controller-after",
        "two-controllers",
        "controller-auth",
        "controller-tls-and-auth-no-token",
        "controller-tls-and-auth-no-tls",
        "controller-tls",
        "two-planners",
    ],
)
def test_a_bad_planner_member_is_one_line_naming_the_file_and_the_member(
    tmp_path: Path, pki: Path, members: str, problem: str
) -> None:
    fleet = _fleet_file(tmp_path, members, pki)
    with pytest.raises(ConfigError) as caught:
        load_fleet(fleet)
    message = str(caught.value)
    assert re.match(rf"invalid config in {re.escape(str(fleet))}\b", message), message
    assert problem in message and "\n" not in message


def test_up_with_a_bad_planner_member_starts_nothing(tmp_path: Path) -> None:
    fleet = _fleet_file(
        tmp_path,
        "  - {name: ctl, kind: controller}\n"
        "  - {name: p, kind: planner, config: {scaling: {tick_s: 0}}}\n",
    )
    result = _up_check(fleet, tmp_path, timeout_s=60)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"kvplane: error: invalid config in {fleet}, member p: scaling.tick_s: Input should be"
        " greater than 0"
    ]
    assert list(tmp_path.glob(f"{WORKDIR_PREFIX}*")) == []


def _failing(folder: Path) -> str:
    """`engine_args` (YAML) that load (`kvplane up` checks them, and the files they name) and
    make an engine exit as it starts: a metrics address not on this machine (TEST-NET-1),
    which its metrics server cannot bind."""
    config = folder / "engine-failing.yaml"
    config.write_text("model: sim\nmetrics_listen: '192.0.2.1:9000'\n")
    return f"[--config, '{config}']"


def _planner_fleet(tmp_path: Path, start_timeout_s: int, planner: str) -> Path:
    """A fleet file of a controller and a planner `p` of config `planner` (YAML)."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        f"start_timeout_s: {start_timeout_s}\n"
        "members:\n"
        "  - {name: ctl, kind: controller}\n"
        f"  - {{name: p, kind: planner, config: {planner}}}\n"
    )
    return fleet


def test_up_reads_the_files_of_a_planner_engines_config_before_starting_any(
    tmp_path: Path,
) -> None:
    """The files the engine config of a planner member's `engine_args` names (here its TLS
    certificate) are read as the engine reads them, before any member starts: one line naming
    the member, the setting, the engine config and the file. Before, the controller and the
    planner started, and each engine the planner started exited on the file, until up gave
    up after start_timeout_s."""
    engine_config = tmp_path / "engine.yaml"
    missing = tmp_path / "missing.pem"
    engine_config.write_text(
        f"model: sim\ntls: {{cert_file: '{missing}', key_file: '{missing}'}}\n"
    )
    fleet = _planner_fleet(
        tmp_path, 10, f"{{live: {{engine_args: [--config, '{engine_config}']}}}}"
    )
    result = _up_check(fleet, tmp_path, timeout_s=60)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"kvplane: error: invalid config in {fleet}, member p: live.engine_args, the arguments"
        f" of `kvplane engine serve`: invalid config in {engine_config}: tls: cannot read"
        f" cert_file {missing}: No such file or directory"
    ]
    assert list(tmp_path.glob(f"{WORKDIR_PREFIX}*")) == []  # no member started


def test_up_refuses_a_planner_whose_engine_args_the_engine_refuses(tmp_path: Path) -> None:
    """A planner member's engine arguments are read as `kvplane engine serve` reads them
    when the fleet file loads: one line naming the member and the setting, no member started
    (before, the planner's engines failed on them one after the other until up gave up)."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        "start_timeout_s: 10\n"  # the old code's planner waited for engines that never served
        "members:\n"
        "  - {name: ctl, kind: controller}\n"
        "  - {name: p, kind: planner, config: {live: {engine_args: [--model, sim, --rol, x]}}}\n"
    )
    result = _up_check(fleet, tmp_path, timeout_s=60)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"kvplane: error: invalid config in {fleet}, member p: live.engine_args, the arguments"
        " of `kvplane engine serve`: No such option: --rol (Possible options: --model, --role)"
    ]
    assert list(tmp_path.glob(f"{WORKDIR_PREFIX}*")) == []  # no member started


@pytest.mark.timeout(60)
def test_a_planner_whose_engines_never_serve_fails_up_in_one_line(tmp_path: Path) -> None:
    """Its engines exit at start (their metrics address cannot be bound, found as an engine
    starts): the planner keeps trying, up gives up after start_timeout_s, names why from the
    planner's log, and leaves no process. (The timeout holds the controller's start too: 4 s
    failed there on a loaded machine.)"""
    fleet = _planner_fleet(
        tmp_path, 10, f"{{scaling: {{tick_s: 1}}, live: {{engine_args: {_failing(tmp_path)}}}}}"
    )
    result = _up_check(fleet, tmp_path, timeout_s=50)
    assert result.returncode == 1, result.stderr
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith(
        "kvplane: error: p did not become ready in 10.0s (not running with its pools' minimum"
        " of engines routed to); its log ends: "
    )
    assert "starting an engine of default failed" in error
    assert _naming(tmp_path) == []


@pytest.mark.timeout(180)
def test_a_member_dying_while_another_starts_fails_the_start_naming_it(tmp_path: Path) -> None:
    """The controller killed while the planner waits for it to route to its engines (which
    never serve here: the planner's engines exit at start) ends the start at once, naming the
    controller and how it ended: before, up went on waiting for the planner for
    `start_timeout_s`, then blamed it, and never said that the controller had died."""
    fleet = _planner_fleet(
        tmp_path, 60, f"{{scaling: {{tick_s: 1}}, live: {{engine_args: {_failing(tmp_path)}}}}}"
    )
    proc = _up(fleet, tmp_path)
    started: dict[str, int] = {}
    try:
        assert proc.stderr is not None
        while "p" not in started:
            line = proc.stderr.readline()
            if not line:
                break
            if found := re.search(r"(\S+) started \(pid (\d+)\)", line):
                started[found.group(1)] = int(found.group(2))
        assert set(started) == {"ctl", "p"}
        os.kill(started["ctl"], signal.SIGKILL)
        _, rest = proc.communicate(timeout=120)
    finally:
        _kill_leftovers(proc, list(started.values()))
    assert proc.returncode == 1, rest
    error = rest.strip().splitlines()[-1]
    assert error.startswith(
        "kvplane: error: ctl exited during start-up with code -9 (SIGKILL): "
    ), rest
    assert "p stopped with code" in rest  # the planner, stopped as the start failed
    assert _naming(tmp_path) == []
