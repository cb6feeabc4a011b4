"""The indexer's config model: what loads is what runs. Numbers that reach C (gRPC channel
arguments, uint32 wire fields) are bounded, ZMQ endpoints and backend URLs have their shape,
names are ones the index takes, and a value of the wrong type is an error, not a coercion.
(`test_indexer_cli.py` runs `kvplane indexer serve` on some of these: one line, exit 1.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from indexer.batch import CacheSpec, Component
from indexer.config import IndexerConfig, OpenEngineSourceConfig, ZmqSourceConfig
from indexer.engine_events import BlockStored
from indexer.index import PrefixIndex
from indexer.memory_backend import MemoryBackend
from indexer.service import build_source
from kvplane.config import load_config, validate_config
from kvplane.errors import ConfigError
from kvplane.zmq_heartbeat import Heartbeat


def _error(data: dict[str, object]) -> str:
    with pytest.raises(ConfigError) as info:
        validate_config(IndexerConfig, data, "indexer.yaml")
    return str(info.value)


def _zmq(**fields: object) -> dict[str, object]:
    source = {"kind": "zmq", "worker_id": "w0", "endpoint": "tcp://127.0.0.1:5557", **fields}
    return {"sources": [source]}


def _openengine(**fields: object) -> dict[str, object]:
    return {"sources": [{"kind": "openengine", "target": "127.0.0.1:9000", **fields}]}


def test_max_request_bytes_fits_grpcs_c_int() -> None:
    assert IndexerConfig(max_request_bytes=(1 << 31) - 1).max_request_bytes == (1 << 31) - 1
    for value in (1 << 31, 99_999_999_999):
        assert _error({"max_request_bytes": value}) == (
            "invalid config in indexer.yaml: max_request_bytes: must be at most "
            f"2147483647 (2 GiB - 1, gRPC's limit), got {value}"
        )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"heartbeat_interval_s": 0}, "heartbeat_interval_s must be between 0.1 and 6553.5"),
        ({"heartbeat_interval_s": -1.0}, "heartbeat_interval_s must be between"),
        # A TTL below a decisecond would go out as 0 (none); above 6553.5 s it does not fit.
        ({"heartbeat_timeout_s": 0.05}, "heartbeat_timeout_s must be between 0.1 and 6553.5"),
        ({"heartbeat_timeout_s": 7000}, "seconds, got 7000"),
    ],
)
def test_heartbeats_are_bounded_as_libzmq_takes_them(
    fields: dict[str, object], message: str
) -> None:
    error = _error(_zmq(**fields))
    assert error.startswith("invalid config in indexer.yaml: sources.0: ")
    assert message in error


@pytest.mark.parametrize("kind", [_zmq, _openengine])
def test_a_sources_heartbeats_reach_its_zmq_settings(
    kind: Callable[..., dict[str, object]],
) -> None:
    """A zmq source's own; an openengine source's for the ZMQ sources it discovers."""
    (default,) = IndexerConfig.model_validate(kind()).sources
    source = build_source(default, MemoryBackend(PrefixIndex()), 16)
    assert source.settings.heartbeat == Heartbeat(interval_s=5.0, timeout_s=20.0)
    (tuned,) = IndexerConfig.model_validate(
        kind(heartbeat_interval_s=1, heartbeat_timeout_s=2.5)
    ).sources
    source = build_source(tuned, MemoryBackend(PrefixIndex()), 16)
    assert source.settings.heartbeat == Heartbeat(interval_s=1.0, timeout_s=2.5)


@pytest.mark.parametrize(
    ("data", "where"),
    [
        ({"block_size": 1 << 32}, "block_size"),
        (_zmq(block_size=1 << 32), "sources.0.block_size"),
        (_openengine(data_parallel_ranks=[0, -1]), "sources.0.data_parallel_ranks.1"),
        (_openengine(data_parallel_ranks=[1 << 32]), "sources.0.data_parallel_ranks.0"),
    ],
)
def test_uint32_wire_fields_are_bounded(data: dict[str, object], where: str) -> None:
    assert f"indexer.yaml: {where}: Input should be" in _error(data)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"writer_lease_s": 0}, "writer_lease_s: Input should be greater than 0"),
        ({"replica_name": "a b"}, "replica_name: must be a non-empty name without spaces or '/'"),
        ({"replica_name": "a/b"}, "replica_name: must be a non-empty name without spaces or '/'"),
        ({"replica_name": ""}, "replica_name: must be a non-empty name without spaces or '/'"),
    ],
)
def test_the_writer_lease_settings_are_checked(data: dict[str, object], message: str) -> None:
    assert f"indexer.yaml: {message}" in _error(data)


def test_uint32_wire_fields_take_their_whole_range() -> None:
    config = IndexerConfig.model_validate(_openengine(data_parallel_ranks=[0, (1 << 32) - 1]))
    (source,) = config.sources
    assert isinstance(source, OpenEngineSourceConfig)
    assert source.data_parallel_ranks == [0, (1 << 32) - 1]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"endpoint": "127.0.0.1:5557"}, "expected a ZMQ endpoint like tcp://HOST:PORT"),
        ({"endpoint": "tcp://127.0.0.1"}, "expected tcp://HOST:PORT, got 'tcp://127.0.0.1'"),
        ({"endpoint": "tcp://no-port"}, "expected tcp://HOST:PORT"),
        ({"endpoint": "tcp://h:5557x"}, "expected tcp://HOST:PORT"),
        ({"endpoint": "tcp://h:65536"}, "port out of range in 'tcp://h:65536'"),
        ({"endpoint": "tpc://h:5557"}, "unknown ZMQ transport 'tpc'"),
        ({"endpoint": ""}, "expected a ZMQ endpoint"),
        ({"endpoint": "tcp://*:5557"}, "'*' in 'tcp://*:5557' is for binding (bind: true)"),
        ({"replay_endpoint": "127.0.0.1:5558"}, "replay_endpoint: expected a ZMQ endpoint"),
        ({"replay_endpoint": "tcp://*:5558", "bind": True}, "replay_endpoint: '*' in"),
    ],
)
def test_zmq_endpoints_have_zmqs_shape(fields: dict[str, object], message: str) -> None:
    error = _error(_zmq(**fields))
    assert error.startswith("invalid config in indexer.yaml: sources.0: ")
    assert message in error


@pytest.mark.parametrize(
    "fields",
    [
        {"endpoint": "tcp://[::1]:5557"},
        {"endpoint": "tcp://eth0:5557"},
        {"endpoint": "tcp://*:5557", "bind": True},
        {"endpoint": "tcp://127.0.0.1:*", "bind": True},
        {"endpoint": "ipc:///tmp/kv.sock", "replay_endpoint": "tcp://127.0.0.1:5558"},
        {"endpoint": "inproc://events"},
    ],
)
def test_valid_zmq_endpoints_load(fields: dict[str, object]) -> None:
    (source,) = IndexerConfig.model_validate(_zmq(**fields)).sources
    assert {name: getattr(source, name) for name in fields} == fields  # as written


@pytest.mark.parametrize(
    ("data", "where"),
    [
        ({"auth": None, "block_size": True}, "block_size"),
        ({"max_concurrent_prefix_queries": "64"}, "max_concurrent_prefix_queries"),
        ({"max_request_bytes": 1.0}, "max_request_bytes"),
        (_zmq(bind="yes"), "sources.0.bind"),
        (_zmq(block_size=True), "sources.0.block_size"),
        (_zmq(replay_timeout_s="5"), "sources.0.replay_timeout_s"),
        (_zmq(heartbeat_interval_s="5"), "sources.0.heartbeat_interval_s"),
        (_zmq(heartbeat_timeout_s=True), "sources.0.heartbeat_timeout_s"),
        (_zmq(receive_queue_bytes=1.5e8), "sources.0.receive_queue_bytes"),
        (_zmq(replay_bytes="1GiB"), "sources.0.replay_bytes"),
        (_openengine(discover_zmq="no"), "sources.0.discover_zmq"),
        (_openengine(data_parallel_ranks=[True]), "sources.0.data_parallel_ranks.0"),
        ({"backend": "redis://h:1/0", "redis": {"buckets": "16"}}, "redis.buckets"),
        ({"backend": "redis://h:1/0", "redis": {"timeout_s": True}}, "redis.timeout_s"),
        ({"backend": "redis://h:1/0", "redis": {"max_buffered_batches": True}}, "redis."),
        ({"writer_lease_s": "10"}, "writer_lease_s"),
        # The shared server block's (kvplane.config.ServerConfig): `true` was 1 s, "5" 5 s.
        ({"shutdown_grace_s": True}, "shutdown_grace_s"),
        ({"shutdown_grace_s": "5"}, "shutdown_grace_s"),
    ],
)
def test_a_value_of_the_wrong_type_is_an_error_not_a_coercion(
    data: dict[str, object], where: str
) -> None:
    assert f"indexer.yaml: {where}" in _error(data)


def test_yamls_own_ints_bools_and_floats_load(tmp_path: Path) -> None:
    config_file = tmp_path / "indexer.yaml"
    config_file.write_text(
        "backend: redis://127.0.0.1:6379/0\n"
        "block_size: 32\n"
        "max_request_bytes: 2147483647\n"
        "redis: {buckets: 64, timeout_s: 2, connect_timeout_s: 0.25}\n"
        "sources:\n"
        "  - {kind: zmq, worker_id: w0, endpoint: 'tcp://*:5557', bind: true,\n"
        "     replay_endpoint: 'tcp://127.0.0.1:5558', replay_timeout_s: 3, block_size: 16,\n"
        "     receive_queue_bytes: 1048576,\n"
        "     replay_bytes: 4194304}\n"
        "  - {kind: openengine, target: '127.0.0.1:9000', discover_zmq: false,\n"
        "     data_parallel_ranks: [0, 1]}\n"
    )
    config = load_config(IndexerConfig, config_file)
    assert (config.block_size, config.redis.timeout_s, config.redis.buckets) == (32, 2.0, 64)
    zmq_source, openengine_source = config.sources
    assert isinstance(zmq_source, ZmqSourceConfig)
    assert isinstance(openengine_source, OpenEngineSourceConfig)
    assert zmq_source.bind is True and zmq_source.replay_timeout_s == 3.0
    assert zmq_source.receive_queue_bytes == 1048576 and zmq_source.replay_bytes == 4194304
    assert openengine_source.discover_zmq is False


def test_a_redis_block_with_the_memory_backend_is_an_error() -> None:
    assert _error({"redis": {"buckets": 64}}) == (
        "invalid config in indexer.yaml: redis: options are for a Redis backend, "
        "but backend is memory: remove the redis: block or set backend to redis://HOST:PORT/DB"
    )
    config = IndexerConfig.model_validate({"backend": "redis://h:1/0", "redis": {"buckets": 64}})
    assert config.backend_options()["buckets"] == 64


@pytest.mark.parametrize(
    ("backend", "tls", "problem"),
    [
        # Before, a key alone was ignored: no TLS at all with redis://.
        (
            "redis://h:1/0",
            {"key_file": "client.key"},
            "redis.tls: cert_file and key_file go together (a client certificate)",
        ),
        (
            "rediss://h:1/0",
            {"ca_file": "ca.pem", "cert_file": "client.pem"},
            "redis.tls: cert_file and key_file go together (a client certificate)",
        ),
        # Before, the index crashed as it opened (a TypeError of redis-py's).
        (
            "unix:///run/redis.sock",
            {"ca_file": "ca.pem"},
            "redis.tls: a unix:// socket carries no TLS (Redis serves TLS on a TCP port), but"
            " backend is unix:///run/redis.sock: remove redis.tls or set backend to"
            " rediss://HOST:PORT/DB",
        ),
    ],
)
def test_redis_tls_that_cannot_be_as_given_is_a_config_error(
    backend: str, tls: dict[str, str], problem: str
) -> None:
    assert _error({"backend": backend, "redis": {"tls": tls}}) == (
        f"invalid config in indexer.yaml: {problem}"
    )


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis://127.0.0.1:6379/abc", "the DB must be a number, got 'abc'"),
        ("redis://127.0.0.1:6379/0?db=x", "the DB must be a number, got 'x'"),
        ("unix:///run/redis.sock?db=-1", "the DB must be a number, got '-1'"),
        ("redis+cluster://127.0.0.1:7000/1", "a Redis Cluster has DB 0 only"),
        ("postgres://127.0.0.1:5432", "unknown index backend 'postgres://127.0.0.1:5432'"),
    ],
)
def test_a_backend_url_without_a_usable_db_is_a_config_error(url: str, message: str) -> None:
    assert message in _error({"backend": url})


@pytest.mark.parametrize(
    "url",
    [
        "memory",
        "redis://127.0.0.1:6379",
        "redis://127.0.0.1:6379/",
        "redis://127.0.0.1:6379/15",
        "rediss://user:pw@redis.example:6380/2",
        "unix:///run/redis.sock?db=3",
        "redis+cluster://127.0.0.1:7000,127.0.0.1:7001",
    ],
)
def test_valid_backend_urls_load(url: str) -> None:
    assert IndexerConfig(backend=url).backend == url


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"worker_id": ""}, "worker_id: worker_id must not be empty"),
        ({"worker_id": "w" * 257}, "worker_id must be at most 256 characters, got 257"),
        ({"worker_id": "w\x000"}, "worker_id must be printable text, got 'w\\x000'"),
        ({"worker_address": "10.0.0.1:8000\n"}, "worker_address must be printable text"),
    ],
)
def test_source_worker_names_are_ones_the_index_takes(
    fields: dict[str, object], message: str
) -> None:
    assert message in _error(_zmq(**fields))
    assert message in _error(_openengine(**fields))


def test_a_source_clears_at_least_one_tier_on_all_blocks_cleared() -> None:
    rule = "clear_tiers: must name at least one tier"
    assert rule in _error(_zmq(clear_tiers=[]))
    assert rule in _error(_openengine(clear_tiers=[]))
    config = IndexerConfig.model_validate(_zmq(clear_tiers=["HBM"]))
    assert [s.clear_tiers for s in config.sources] == [["HBM"]]


def test_a_declared_vllm_hash_is_for_engine_hashes_and_seeds_only_with_it() -> None:
    """`vllm_hash` / `hash_seed` say how a `hash: engine` source's engines hash (GetIndexStats
    `keyings`): on a canonical source, or a seed without its algorithm, they would be
    reported for keys they do not describe."""
    assert "vllm_hash is for hash: engine" in _error(_zmq(hash="canonical", vllm_hash="sha256"))
    assert "hash_seed needs vllm_hash" in _error(_openengine(hash_seed="0"))
    config = IndexerConfig.model_validate(_zmq(vllm_hash="sha256_cbor", hash_seed="0"))
    assert [(s.vllm_hash, s.hash_seed) for s in config.sources] == [("sha256_cbor", "0")]


def test_the_longest_printable_worker_id_loads() -> None:
    config = IndexerConfig.model_validate(_zmq(worker_id="w" * 256, worker_address="héte:1"))
    assert [(s.worker_id, s.worker_address) for s in config.sources] == [("w" * 256, "héte:1")]


def test_a_hybrid_models_kv_cache_groups_configure_its_sources_spec() -> None:
    """Configured groups reach the source's translator: its first batch carries the spec and
    component masks; a window on a kind without one, or an empty kind, is an error."""
    groups = [{"kind": "full_attention"}, {"kind": "sliding_window", "sliding_window": 4096}]
    config = IndexerConfig.model_validate(_zmq(kv_cache_groups=groups))
    source = build_source(config.sources[0], MemoryBackend(PrefixIndex()), 16)
    (batch,) = source.translator.translate([BlockStored((7,), medium="GPU")])
    assert batch.cache_spec == CacheSpec(1, 3, 4095, 0b110, 0b110, 0)
    assert batch.actions[0].component_masks == (Component.FULL,)
    window_on_full = [{"kind": "full_attention", "sliding_window": 8}]
    assert "sliding_window is for sliding-window kinds, not 'full_attention'" in _error(
        _zmq(kv_cache_groups=window_on_full)
    )
    assert "kv_cache_groups.0.kind" in _error(_openengine(kv_cache_groups=[{"kind": ""}]))


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (
            {"backend": "redis://app:hunter2@h:1/zero"},
            "backend: backend 'redis://app:***@h:1/zero': the DB must be a number, got 'zero'",
        ),
        (  # an @ in the password, as redis-py takes it (the host follows the last @)
            {"backend": "redis://app:x@hunter2@h:1/zero"},
            "backend: backend 'redis://app:***@h:1/zero': the DB must be a number, got 'zero'",
        ),
        (
            {"backend": "redis+cluster://:hunter2@h:1/3"},
            "backend: backend 'redis+cluster://:***@h:1/3': a Redis Cluster has DB 0 only",
        ),
        (
            {
                "backend": "unix:///run/redis.sock?password=hunter2&db=1",
                "redis": {"tls": {"ca_file": "ca.pem"}},
            },
            "redis.tls: a unix:// socket carries no TLS (Redis serves TLS on a TCP port), but"
            " backend is unix:///run/redis.sock?password=***&db=1: remove redis.tls or set"
            " backend to rediss://HOST:PORT/DB",
        ),
        (
            {
                "backend": "unix:///run/redis.sock?db=1&password=hunter2",
                "redis": {"tls": {"ca_file": "ca.pem"}},
            },
            "redis.tls: a unix:// socket carries no TLS (Redis serves TLS on a TCP port), but"
            " backend is unix:///run/redis.sock?db=1&password=***: remove redis.tls or set"
            " backend to rediss://HOST:PORT/DB",
        ),
    ],
)
def test_a_password_in_the_backend_url_is_not_shown_in_its_error(
    data: dict[str, object], problem: str
) -> None:
    """A Redis URL may carry its password (redis-py takes one there, beside
    redis.password_file): an error about the URL names it with the password as `***`, as it
    would end up in a log or a terminal."""
    message = _error(data)
    assert "hunter2" not in message
    assert message == f"invalid config in indexer.yaml: {problem}"
