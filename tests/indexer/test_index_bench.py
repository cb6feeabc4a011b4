"""`kvplane bench index` at a tiny scale: every workload runs, and the JSON document has the
figures docs/benchmarks cite, with and without Dynamo's RadixTree installed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from indexer import bench
from indexer.bench import Scale, run_index_bench
from kvplane.cli import app
from kvplane.errors import KvplaneError
from tests.redis_servers import RedisServer, free_port

pytestmark = pytest.mark.timeout(120)

TINY = Scale(
    one_block_events=200,
    chain_events=20,
    match_queries=100,
    remove_blocks=640,
    mooncake_requests=20,
    memory_blocks=6_400,
    service_blocks=6_400,
    service_seconds=0.2,
    repeats=1,
    match_chains=20,
)
WORKLOADS = {
    "store_1_block_events",
    "store_64_block_events",
    "match_64_block_prefixes",
    "remove_worker",
    "mooncake_store",
    "mooncake_match",
}


@pytest.mark.parametrize("dynamo", ["hidden", "as-installed"])
async def test_bench_index_reports_every_figure(
    dynamo: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    installed = bench.dynamo_available()
    if dynamo == "hidden":  # the figures without ai-dynamo-runtime, whether or not it is here
        monkeypatch.setattr(bench, "dynamo_available", lambda: False)
    with_dynamo = dynamo == "as-installed" and installed
    result = await run_index_bench("memory", scale=TINY)

    assert set(result["workloads"]) == WORKLOADS
    for name, figures in result["workloads"].items():
        assert figures["kvplane_ops_s"] > 0, name
        if with_dynamo:
            assert figures["dynamo_ops_s"] > 0, name
            ratio = figures["kvplane_ops_s"] / figures["dynamo_ops_s"]
            assert figures["ratio"] == pytest.approx(ratio, rel=1e-2), name
        else:
            assert figures["dynamo_ops_s"] is None and figures["ratio"] is None, name
    assert result["dynamo"] == ("ai-dynamo-runtime 1.6.1" if with_dynamo else "absent")

    service = result["service"]
    assert service["indexed_blocks"] == TINY.service_blocks
    assert 0 < service["match_p50_ms"] <= service["match_p99_ms"]
    assert service["match_qps"] > 0 and service["match_failed"] == 0
    assert result["memory"]["bytes_per_placement"] > 0
    assert result["memory"]["placements"] == TINY.memory_blocks
    rendered = bench.render_table(result)
    assert "memory:" in rendered and "service MatchExternalKvPrefix" in rendered
    # Without Dynamo the table says how to have it (it said only "dynamo: absent").
    how = "dynamo: absent (pip install ai-dynamo-runtime==1.6.1 to compare)"
    assert (how in rendered) is not with_dynamo


async def test_bench_index_on_redis_leaves_no_key_behind(redis_server: RedisServer) -> None:
    """The benchmark writes into partitions of its own and deletes them: a shared Redis keeps
    no benchmark data (removing the workers alone left the block keys: ~476k a run)."""
    client = redis_server.client()
    client.set("someone-elses-key", "kept")
    before = client.dbsize()
    result = await run_index_bench(redis_server.url, quick=True, scale=TINY)
    assert result["workloads"]["mooncake_store"]["kvplane_ops_s"] > 0
    assert client.dbsize() == before
    assert client.get("someone-elses-key") == b"kept"


def test_bench_index_on_a_redis_that_does_not_answer_is_one_line() -> None:
    """Was a redis ConnectionError traceback: the backend buffered what the first workload
    sent, then failed deleting its partition."""
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    result = CliRunner().invoke(app, ["bench", "index", "--quick", "--backend", url])
    assert result.exit_code == 1
    assert isinstance(result.exception, KvplaneError)
    assert str(result.exception) == f"cannot benchmark {url}: Redis does not answer there"


async def test_bench_index_reports_a_redis_url_without_its_password(tmp_path: Path) -> None:
    """A password in the --backend URL is `***` in the report (its table and its JSON, which
    a run's results keep): it was printed as given."""
    guarded = RedisServer(tmp_path / "redis", extra_args=("--requirepass", "hunter2"))
    guarded.start()
    try:
        url = f"redis://:hunter2@127.0.0.1:{guarded.port}/0"
        result = await run_index_bench(url, quick=True, scale=TINY)
    finally:
        guarded.stop()
    assert result["workloads"]["mooncake_store"]["kvplane_ops_s"] > 0
    assert result["backend"] == f"redis://:***@127.0.0.1:{guarded.port}/0"
    assert bench.render_table(result).startswith(f"backend: {result['backend']} ")
    assert "hunter2" not in json.dumps(result)


def test_bench_index_names_a_redis_that_does_not_answer_without_its_password() -> None:
    url = f"redis://app:hunter2@127.0.0.1:{free_port()}/0"  # nothing listens there
    result = CliRunner().invoke(app, ["bench", "index", "--quick", "--backend", url])
    assert result.exit_code == 1
    assert str(result.exception) == (
        f"cannot benchmark {url.replace('hunter2', '***')}: Redis does not answer there"
    )


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("foo", "unknown index backend 'foo'"),
        ("redis://127.0.0.1:6379/abc", "the DB must be a number, got 'abc'"),
    ],
)
def test_bench_index_on_a_url_naming_no_backend_is_a_usage_error(url: str, message: str) -> None:
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["bench", "index", "--backend", url])
    assert result.exit_code == 2
    assert "Invalid value for --backend: " in result.output and message in result.output
