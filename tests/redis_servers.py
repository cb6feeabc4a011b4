"""Private redis-server processes for tests: one node, or a 3-node Redis Cluster (with
replicas if asked), and a slot moved between cluster nodes step by step.

Each server listens on 127.0.0.1 on a free port, in its own temporary directory, without
persistence. `redis-server` and `redis-cli` come from the Debian package (/usr/bin).
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis
from redis.crc import key_slot

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll `condition` until it holds; AssertionError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


# Ports handed out by this process: a port picked and not bound yet (a fleet's ports are picked
# before its processes start), or whose process is down for a restart, is bindable again, and
# must not be picked twice.
_HANDED_OUT: set[int] = set()


def _worker_range(low: int, high: int) -> range:
    """The part of ports [low, high) this process picks from: under pytest-xdist each worker
    its own slice (`PYTEST_XDIST_WORKER` gwN of `PYTEST_XDIST_WORKER_COUNT`), so that no
    other worker's test binds a port this one picked (a check that a port is free says
    nothing of the port's next moment); the whole range otherwise."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(worker.removeprefix("gw")) if worker.startswith("gw") else 0
    size = (high - low) // count
    return range(low + index * size, low + (index + 1) * size)


def _pick_port(ports: range, also_free: Callable[[int], bool] = lambda port: True) -> int:
    rng = random.Random()
    for _ in range(200):
        port = rng.choice(ports)
        if port not in _HANDED_OUT and _bindable(port) and also_free(port):
            _HANDED_OUT.add(port)
            return port
    raise AssertionError(f"no free port in {ports.start}..{ports.stop - 1}")


def restartable_port() -> int:
    """A free port below the kernel's ephemeral range (`ip_local_port_range`), for a process
    killed and started again on the same port: a port from that range (what binding port 0
    gives) may meanwhile be the local end of some connection, and the restart's bind fails
    (EADDRINUSE). Below the ports of Redis Cluster nodes (`free_cluster_port`)."""
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return _pick_port(_worker_range(10000, min(20000, ephemeral_low)))


def free_cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too, both below 65536."""
    return _pick_port(_worker_range(20000, 30000), lambda port: _bindable(port + 10000))


class RedisServer:
    """One redis-server child process; `kill` and `start` again keep its port."""

    def __init__(
        self,
        workdir: Path,
        *,
        cluster: bool = False,
        extra_args: tuple[str, ...] = (),
        port: int | None = None,
    ) -> None:
        self.workdir = workdir
        self.cluster = cluster
        self.extra_args = extra_args
        self.port = port or (free_cluster_port() if cluster else free_port())
        self.proc: subprocess.Popen[bytes] | None = None
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def password(self) -> str | None:
        """The password it asks for (`--requirepass`), or None."""
        if "--requirepass" not in self.extra_args:
            return None
        return self.extra_args[self.extra_args.index("--requirepass") + 1]

    def client(self) -> redis.Redis:
        return redis.Redis(
            host="127.0.0.1", port=self.port, socket_timeout=5, password=self.password
        )

    def command(self, *args: str | int | bytes) -> Any:
        """A raw command on a new client: redis-py leaves the sync client's execute_command
        unannotated, and its reply depends on the command."""
        execute: Callable[..., Any] = self.client().execute_command
        return execute(*args)

    def start(self) -> None:
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no", "--dir", str(self.workdir)]
        args += ["--logfile", str(self.workdir / "redis.log")]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
            args += ["--cluster-node-timeout", "2000"]
        args += self.extra_args
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        wait_for(self.answers, 10, f"redis-server on port {self.port}")

    def answers(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"redis-server on port {self.port} exited: see {self.workdir}")
        try:
            return bool(self.client().ping())
        except redis.RedisError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def flushall(self) -> None:
        self.client().flushall()

    def break_saves(self) -> None:
        """Make Redis unable to persist, as a full or read-only disk would: snapshots on
        (`save`), and a directory where its RDB file goes, so that BGSAVE fails to rename its
        temporary file there (whatever the user: root ignores permissions). Under
        `stop-writes-on-bgsave-error yes` (Redis's default) Redis then refuses every write
        (MISCONF) until a save succeeds (`mend_saves`)."""
        self.command("CONFIG", "SET", "save", "3600 1")  # none due: no save of its own
        self._rdb_file().mkdir()
        self._save_and_wait("err")

    def mend_saves(self) -> None:
        """Undo `break_saves`: the RDB file's place is free again, and a BGSAVE succeeds."""
        self._rdb_file().rmdir()
        self._save_and_wait("ok")

    def _rdb_file(self) -> Path:
        config = self.client().config_get("dir") | self.client().config_get("dbfilename")
        return Path(str(config["dir"])) / str(config["dbfilename"])

    def _save_and_wait(self, status: str) -> None:
        self.command("BGSAVE")

        def saved() -> bool:
            info = self.client().info("persistence")
            return not info["rdb_bgsave_in_progress"] and info["rdb_last_bgsave_status"] == status

        wait_for(saved, 10, f"BGSAVE to end with status {status}")


@contextmanager
def running_redis(workdir: Path) -> Iterator[RedisServer]:
    """A started redis-server in `workdir`, stopped on leaving the block."""
    server = RedisServer(workdir)
    try:
        server.start()
        yield server
    finally:
        server.stop()


class RedisClusterNodes:
    """Three primaries covering all slots, each with `replicas` replicas."""

    def __init__(
        self, workdir: Path, *, replicas: int = 0, extra_args: tuple[str, ...] = ()
    ) -> None:
        self.replicas = replicas
        if replicas:  # a replica syncs at once (Redis waits 5 s for more replicas to join)
            extra_args = ("--repl-diskless-sync-delay", "0", *extra_args)
        self.nodes = [
            RedisServer(workdir / f"node{i}", cluster=True, extra_args=extra_args)
            for i in range(3 * (1 + replicas))
        ]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        password = self.nodes[0].password
        subprocess.run(
            [REDIS_CLI, *(("--no-auth-warning", "-a", password) if password else ())]
            + ["--cluster", "create"]
            + [f"127.0.0.1:{n.port}" for n in self.nodes]
            + ["--cluster-replicas", str(self.replicas), "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        self.wait_ok()

    def _ok(self) -> bool:
        for node in self.nodes:
            if node.proc is None:  # killed
                continue
            info = node.command("CLUSTER", "INFO")
            text = info.decode() if isinstance(info, bytes) else str(info)
            if "cluster_state:ok" not in text:
                return False
        return True

    def flushall(self) -> None:
        for node in self.nodes:
            node.flushall()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def node_of(self, key: str) -> RedisServer:
        """The node serving `key`'s slot (as a running node sees it)."""
        slot = key_slot(key.encode())
        asked = next(n for n in self.nodes if n.proc is not None)
        for first, last, primary, *_ in asked.command("CLUSTER", "SLOTS"):
            if first <= slot <= last:
                return next(n for n in self.nodes if n.port == int(primary[1]))
        raise AssertionError(f"no node serves slot {slot}")

    def wait_ok(self) -> None:
        wait_for(self._ok, 30, "cluster_state:ok on every node")
        wait_for(self._replicas_synced, 30, "every replica in sync with its primary")

    def _replicas_synced(self) -> bool:
        for node in self.nodes:
            info = node.client().info("replication") if node.proc is not None else {}
            if info.get("role") == "slave" and info.get("master_link_status") != "up":
                return False
        return True

    def replica_of(self, primary: RedisServer) -> RedisServer:
        for node in self.nodes:
            info = node.client().info("replication") if node.proc is not None else {}
            if info.get("role") == "slave" and int(info["master_port"]) == primary.port:
                return node
        raise AssertionError(f"no replica of the node on port {primary.port}")

    def fail_over(self, primary: RedisServer, replica: RedisServer) -> None:
        """Kill `primary` and wait for `replica` to take over and the cluster to be whole."""
        primary.kill()
        wait_for(lambda: replica.client().info("replication")["role"] == "master", 30, "failover")
        self.wait_ok()


class SlotMove:
    """Moves one slot between two nodes step by step, as `redis-cli --cluster reshard` does:
    IMPORTING on the target, MIGRATING on the source, MIGRATE key by key, then SETSLOT NODE
    on every node."""

    def __init__(self, cluster: RedisClusterNodes, key: str, target: RedisServer) -> None:
        self.cluster = cluster
        self.slot = key_slot(key.encode())
        self.source = cluster.node_of(key)
        self.target = target
        assert self.source is not target
        self.target_id = _node_id(target)

    def begin(self) -> None:
        self.target.command("CLUSTER", "SETSLOT", self.slot, "IMPORTING", _node_id(self.source))
        self.source.command("CLUSTER", "SETSLOT", self.slot, "MIGRATING", self.target_id)

    def keys_left(self) -> list[bytes]:
        keys: list[bytes] = self.source.command("CLUSTER", "GETKEYSINSLOT", self.slot, 100_000)
        return keys

    def migrate(self, keys: list[bytes]) -> None:
        """MIGRATE without REPLACE: a key the target holds already fails (BUSYKEY)."""
        self.source.command("MIGRATE", "127.0.0.1", self.target.port, "", 0, 5000, "KEYS", *keys)

    def finish(self) -> None:
        left = self.keys_left()
        if left:
            self.migrate(left)
        for node in self.cluster.nodes:
            node.command("CLUSTER", "SETSLOT", self.slot, "NODE", self.target_id)


def _node_id(node: RedisServer) -> str:
    node_id: bytes = node.command("CLUSTER", "MYID")
    return node_id.decode()
