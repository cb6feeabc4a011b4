"""The planner's config: cross-field checks raise with a clear message, and `kvplane planner
run` refuses a bad file with a ConfigError (which `kvplane`'s main prints as one line, exit 1)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from kvplane.cli import app
from kvplane.config import validate_config
from kvplane.errors import ConfigError
from planner.config import LiveConfig, PlannerConfig, PoolConfig, ScalingConfig


def test_max_below_min_is_refused() -> None:
    with pytest.raises(ValidationError, match=r"max_engines \(1\) is below min_engines \(2\)"):
        PoolConfig(name="p", min_engines=2, max_engines=1)


def test_a_start_backoff_whose_maximum_is_below_its_first_wait_is_refused() -> None:
    with pytest.raises(
        ValidationError, match=r"start_backoff_max_s \(5\) is below start_backoff_s \(10\)"
    ):
        LiveConfig(controller="127.0.0.1:1", start_backoff_max_s=5)


def test_pools_are_named_once() -> None:
    with pytest.raises(ValidationError, match="pools listed twice: a"):
        PlannerConfig(pools=(PoolConfig(name="a"), PoolConfig(name="a")))


def test_scale_to_zero_is_not_offered() -> None:
    with pytest.raises(
        ValidationError, match=r"min_engines\n  Input should be greater than or equal to 1"
    ):
        PoolConfig(min_engines=0)


def test_a_drain_deadline_beyond_what_drain_carries_is_refused() -> None:
    # Drain's deadline_ms is a uint32: a longer deadline would fail every drain, leaving the
    # engines the planner drains routed to.
    with pytest.raises(
        ValidationError,
        match=r"drain_deadline_s\n  Input should be less than or equal to 4294967.295",
    ):
        ScalingConfig(drain_deadline_s=5_000_000)


def test_live_controller_must_be_host_port() -> None:
    with pytest.raises(ValidationError, match="HOST:PORT"):
        LiveConfig(controller="http://controller")


BAD_CONFIGS = {
    "pools: [{name: a, min_engines: 3, max_engines: 2}]\n": "below min_engines",
    "sla: {ttft_ms: -1}\n": "ttft_ms",
    "scaling: {tick_s: 5, typo: 1}\n": "typo",
    "capacity: {max_prefill_share: 0}\n": "max_prefill_share",
    "live: {controller: 'localhost'}\n": "HOST:PORT",
    "live: {controller: '127.0.0.1:1', metrics_listen: 'http://h:1'}\n": "metrics_listen",
    "live: {controller: '127.0.0.1:1', lost_after_failed_polls: 0}\n": "lost_after_failed_polls",
    "live: {controller: '127.0.0.1:1', start_backoff_crash_s: -1}\n": "start_backoff_crash_s",
    "pools: [{name: a}, {name: b}]\n"
    "live: {controller: 'c:1', kubernetes: {deployments: {a: engine}}}\n": "no Deployment for "
    "pool(s) b",
    "live: {controller: 'c:1', kubernetes: {deployments: {default: e, other: e}}}\n": "pools "
    "share a Deployment: e",
    "live: {controller: 'c:1', engine_args: [], kubernetes: {deployments: {default: e}}}\n": (
        "engine_args start local engines"
    ),
    "live: {controller: 'c:1', kubernetes: {deployments: {default: Engine_1}}}\n": "pattern",
    "pools: [{name: p, engine_args: [--role, prefill]}]\n"
    "live: {controller: 'c:1', kubernetes: {deployments: {p: e}}}\n": "pools p: engine_args "
    "start local engines",
    "live: {controller: 'c:1', kubernetes: {deployments: {default: e}, leader_election: "
    "{renew_deadline_s: 15}}}\n": "renew_deadline_s (15) must be below lease_duration_s (15)",
    "live: {controller: 'c:1', kubernetes: {deployments: {default: e}, leader_election: "
    "{retry_period_s: 9}}}\n": "renew_deadline_s (10) must be above 1.2 times retry_period_s",
    "live: {controller: 'c:1', kubernetes: {deployments: {default: e}, leader_election: "
    "{lease_name: Planner}}}\n": "lease_name",
}


@pytest.mark.parametrize("text", BAD_CONFIGS)
def test_planner_run_refuses_a_bad_config(tmp_path: Path, text: str) -> None:
    path = tmp_path / "planner.yaml"
    path.write_text(text)
    result = CliRunner().invoke(app, ["planner", "run", "--config", str(path)])
    assert result.exit_code == 1
    assert isinstance(result.exception, ConfigError)
    assert BAD_CONFIGS[text] in str(result.exception)


def test_a_metrics_address_in_use_is_one_line_before_any_engine_starts(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        metrics = f"127.0.0.1:{busy.getsockname()[1]}"
        path = tmp_path / "planner.yaml"
        work = tmp_path / "work"
        live = f"{{controller: '127.0.0.1:1', metrics_listen: '{metrics}', workdir: '{work}'}}"
        path.write_text(f"live: {live}\n")
        result = CliRunner().invoke(app, ["planner", "run", "--config", str(path)])
    assert result.exit_code == 1
    assert isinstance(result.exception, ConfigError)
    assert str(result.exception) == f"cannot serve metrics on {metrics}: Address already in use"
    assert not work.exists()  # refused before the engines' folder (port files, logs) is made


@pytest.mark.parametrize(
    ("workdir", "problem"),
    [
        ("{file}", "live.workdir {file} is a file, not a folder"),
        ("{file}/engines", "cannot make live.workdir {file}/engines: Not a directory"),
    ],
)
def test_a_workdir_that_cannot_be_a_folder_is_one_line(
    tmp_path: Path, workdir: str, problem: str
) -> None:
    """`live.workdir` naming a file (or a folder under one): one line naming the setting,
    exit 1, before any engine starts. Was a FileExistsError's traceback."""
    file = tmp_path / "not-a-folder"
    file.write_text("")
    path = tmp_path / "planner.yaml"
    path.write_text(
        f"live: {{controller: '127.0.0.1:1', workdir: '{workdir.format(file=file)}'}}\n"
    )
    result = CliRunner().invoke(app, ["planner", "run", "--config", str(path)])
    assert result.exit_code == 1
    assert isinstance(result.exception, ConfigError)
    assert str(result.exception) == problem.format(file=file)


_LIVE = {"controller": "127.0.0.1:8100"}


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        # Lax pydantic took these: `true` as 1 s, "5" as 5.
        ({"scaling": {"tick_s": True}}, "scaling.tick_s: Input should be a valid number"),
        ({"scaling": {"tick_s": "5"}}, "scaling.tick_s: Input should be a valid number"),
        ({"sla": {"ttft_ms": "1000"}}, "sla.ttft_ms: Input should be a valid number"),
        (
            {"pools": [{"min_engines": True}]},
            "pools.0.min_engines: Input should be a valid integer",
        ),
        ({"pools": [{"max_engines": "4"}]}, "pools.0.max_engines: Input should be a valid integer"),
        (
            {"capacity": {"max_kv_usage": True}},
            "capacity.max_kv_usage: Input should be a valid number",
        ),
        (
            {"live": {**_LIVE, "start_timeout_s": "120"}},
            "live.start_timeout_s: Input should be a valid number",
        ),
        (
            {"live": {**_LIVE, "lost_after_failed_polls": 3.0}},
            "live.lost_after_failed_polls: Input should be a valid integer",
        ),
        (
            {
                "live": {
                    **_LIVE,
                    "kubernetes": {
                        "deployments": {"default": "engines"},
                        "leader_election": {"lease_duration_s": "15"},
                    },
                }
            },
            "live.kubernetes.leader_election.lease_duration_s: Input should be a valid integer",
        ),
    ],
)
def test_a_value_of_the_wrong_type_is_an_error_not_a_coercion(
    data: dict[str, object], problem: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        validate_config(PlannerConfig, data, "planner.yaml")
    assert f"invalid config in planner.yaml: {problem}" in str(caught.value)


def test_yamls_own_numbers_load() -> None:
    """A whole number is a float setting's too; an engine role is read from a string."""
    config = validate_config(
        PlannerConfig,
        {
            "scaling": {"tick_s": 2},
            "pools": [{"name": "p", "role": "decode", "min_engines": 2}],
            "live": {**_LIVE, "start_timeout_s": 60},
        },
        "planner.yaml",
    )
    assert (config.scaling.tick_s, config.pools[0].min_engines) == (2.0, 2)
    assert config.pools[0].role is not None and config.pools[0].role.value == "decode"
    assert config.live is not None and config.live.start_timeout_s == 60.0


@pytest.mark.parametrize(
    ("engine_args", "pool_args", "problem"),
    [
        (
            "[--modle, sim]",
            "",
            "live.engine_args, the arguments of `kvplane engine serve`: No such option: --modle"
            " (Possible options: --model, --role)",
        ),
        (
            "[--model, sim]",
            "[--role, prefil]",
            "live.engine_args with pools.0.engine_args (pool default), the arguments of"
            " `kvplane engine serve`: Invalid value for --role: Input should be 'aggregated',"
            " 'prefill' or 'decode'",
        ),
        (
            "[--model, '{tmp}/no-such-model']",
            "",
            "live.engine_args, the arguments of `kvplane engine serve`: Invalid value for"
            " --model: model '{tmp}/no-such-model' is not 'sim', 'builtin' or an HF model"
            " directory (one holding config.json)",
        ),
        (
            "[--config, '{tmp}/engine.yaml']",
            "",
            "live.engine_args, the arguments of `kvplane engine serve`: invalid config in"
            " {tmp}/engine.yaml: num_kv_blocks: Input should be a valid integer",
        ),
        # A file the engine config names, read as the engine reads it (as `kvplane up` reads
        # a planner member's): before, the planner started, and each engine failed on it.
        (
            "[--config, '{tmp}/engine-tls.yaml']",
            "",
            "live.engine_args, the arguments of `kvplane engine serve`: invalid config in"
            " {tmp}/engine-tls.yaml: tls: cannot read cert_file {tmp}/missing.pem: No such file"
            " or directory",
        ),
    ],
)
@pytest.mark.timeout(60)  # the old code retried the engines for good
def test_planner_run_refuses_engine_args_the_engine_refuses_before_starting_one(
    tmp_path: Path, engine_args: str, pool_args: str, problem: str
) -> None:
    """The arguments of the planner's local engines are read as `kvplane engine serve` reads
    them (its options, the engine's config model, the files it names) when the planner
    loads: one line naming the setting, exit 1, no engine started. Before, each engine it
    started failed on them, and the planner went on retrying."""
    (tmp_path / "engine.yaml").write_text("model: sim\nnum_kv_blocks: '100'\n")
    missing = tmp_path / "missing.pem"
    (tmp_path / "engine-tls.yaml").write_text(
        f"model: sim\ntls: {{cert_file: '{missing}', key_file: '{missing}'}}\n"
    )
    work = tmp_path / "work"
    pool = f", engine_args: {pool_args}" if pool_args else ""
    path = tmp_path / "planner.yaml"
    path.write_text(
        f"pools: [{{name: default{pool}}}]\n"
        f"live: {{controller: '127.0.0.1:1', workdir: '{work}', "
        f"engine_args: {engine_args.replace('{tmp}', str(tmp_path))}}}\n"
    )
    result = CliRunner().invoke(app, ["planner", "run", "--config", str(path)])
    assert result.exit_code == 1
    assert isinstance(result.exception, ConfigError)
    assert str(result.exception) == (
        f"invalid config in {path}: {problem.replace('{tmp}', str(tmp_path))}"
    )
    assert not work.exists()  # refused before the engines' folder is made


def test_planner_run_reads_its_engines_files_by_the_engines_list_not_kvplane_ups(
    tmp_path: Path,
) -> None:
    """The files a planner's local engines read as they start (their TLS files here) are the
    engine's own list (`engine.start_files`), which `kvplane planner run` reads as it loads
    without `kvplane up`'s preflight of a fleet's members (nor torch): `up` depends on the
    planner and the engine, not the planner on `up`. Before, the planner's command imported
    that preflight for it."""
    missing = tmp_path / "missing.pem"
    engine = tmp_path / "engine.yaml"
    engine.write_text(f"model: sim\ntls: {{cert_file: '{missing}', key_file: '{missing}'}}\n")
    path = tmp_path / "planner.yaml"
    path.write_text(
        f"pools: [{{name: default}}]\n"
        f"live: {{controller: '127.0.0.1:1', workdir: '{tmp_path / 'work'}', "
        f"engine_args: [--config, '{engine}']}}\n"
    )
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from kvplane.cli import app\n"
        f"result = CliRunner().invoke(app, ['planner', 'run', '--config', {str(path)!r}])\n"
        "print(result.exit_code, result.exception)\n"
        "print(sorted(m for m in ('kvplane.up.preflight', 'torch') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    said, imported = result.stdout.strip().splitlines()
    assert said == (
        f"1 invalid config in {path}: live.engine_args, the arguments of `kvplane engine"
        f" serve`: invalid config in {engine}: tls: cannot read cert_file {missing}: No such"
        " file or directory"
    )
    assert imported == "[]"
