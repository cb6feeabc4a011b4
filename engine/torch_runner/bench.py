"""`kvplane bench engine`: the torch engine's throughput and TTFT (BENCHMARKS.md section 3).

Measured through EngineCore (scheduler, block manager, prefix cache, runner), in this process:

- output tokens/s with `c` requests in flight (closed loop: a finished request is replaced at
  once until `2c` have run), prompts and outputs of mixed lengths, greedy, EOS ignored;
- TTFT of a long prompt on an empty cache (cold) and again once its blocks are cached.

Side by side, when `transformers` is installed (a dev dependency only), HF `generate` on the same
checkpoint, same prompts, in batches of `c` (left padding, KV cache on), counting only the
tokens each request asked for. Without it the document says so and reports kvplane alone.

`--model random-LxH` writes a random Llama checkpoint with L layers and hidden size H (for
example `random-8x512`) to a temporary directory: the tiny checkpoint is dominated by
per-step overheads, a larger one by the matmuls.

Importing this module does not import torch (the CLI registers the command at start-up).
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from engine.core.api import EngineRequest, SamplingParams, SchedulerConfig
from engine.core.engine_core import EngineCore
from kvplane.cli_common import OutputFormat, OutputOption, emit, usage_error_for
from kvplane.errors import KvplaneError

if TYPE_CHECKING:
    from engine.torch_runner.runner import TorchModelRunner

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineBenchSettings:
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    num_blocks: int = 4096
    max_num_batched_tokens: int = 2048
    concurrency: tuple[int, ...] = (1, 8, 32)
    prompt_tokens: tuple[int, int] = (32, 256)  # uniform range of prompt lengths
    output_tokens: tuple[int, int] = (32, 128)  # uniform range of output lengths
    ttft_prompt_tokens: int = 1024
    ttft_rounds: int = 3
    threads: int | None = None
    seed: int = 0
    compare_hf: bool = True


@dataclass(frozen=True, slots=True)
class _Job:
    prompt: tuple[int, ...]
    max_tokens: int


def write_random_llama(
    directory: Path,
    *,
    num_layers: int,
    hidden_size: int,
    vocab_size: int = 32000,
    seed: int = 0,
) -> Path:
    """A random LlamaForCausalLM in HF format: head_dim 64, GQA 2:1, SwiGLU at ~2.75x."""
    import torch
    from safetensors.torch import save_file

    num_heads = max(1, hidden_size // 64)
    num_kv_heads = max(1, num_heads // 2)
    head_dim = hidden_size // num_heads
    inter = (int(hidden_size * 2.75) + 63) // 64 * 64
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / math.sqrt(shape[-1])

    state = {"model.embed_tokens.weight": randn(vocab_size, hidden_size)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        state |= {
            p + "input_layernorm.weight": torch.ones(hidden_size),
            p + "post_attention_layernorm.weight": torch.ones(hidden_size),
            p + "self_attn.q_proj.weight": randn(num_heads * head_dim, hidden_size),
            p + "self_attn.k_proj.weight": randn(num_kv_heads * head_dim, hidden_size),
            p + "self_attn.v_proj.weight": randn(num_kv_heads * head_dim, hidden_size),
            p + "self_attn.o_proj.weight": randn(hidden_size, num_heads * head_dim),
            p + "mlp.gate_proj.weight": randn(inter, hidden_size),
            p + "mlp.up_proj.weight": randn(inter, hidden_size),
            p + "mlp.down_proj.weight": randn(hidden_size, inter),
        }
    state["model.norm.weight"] = torch.ones(hidden_size)
    state["lm_head.weight"] = randn(vocab_size, hidden_size)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "intermediate_size": inter,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file(state, str(directory / "model.safetensors"))
    return directory


def _jobs(
    num: int, vocab_size: int, settings: EngineBenchSettings, rng: random.Random
) -> list[_Job]:
    return [
        _Job(
            prompt=tuple(
                rng.randrange(4, vocab_size) for _ in range(rng.randint(*settings.prompt_tokens))
            ),
            max_tokens=rng.randint(*settings.output_tokens),
        )
        for _ in range(num)
    ]


def _new_core(runner: TorchModelRunner, settings: EngineBenchSettings, max_seqs: int) -> EngineCore:
    config = SchedulerConfig(
        max_num_seqs=max_seqs, max_num_batched_tokens=settings.max_num_batched_tokens
    )
    return EngineCore(runner, config)


def _request(request_id: str, job: _Job) -> EngineRequest:
    sampling = SamplingParams(temperature=0.0, max_tokens=job.max_tokens, ignore_eos=True)
    return EngineRequest(request_id=request_id, prompt_token_ids=job.prompt, sampling=sampling)


def _kvplane_throughput(
    runner: TorchModelRunner, jobs: list[_Job], concurrency: int, settings: EngineBenchSettings
) -> dict[str, float]:
    core = _new_core(runner, settings, max_seqs=concurrency)
    pending = list(enumerate(jobs))
    in_flight = 0
    output_tokens = 0
    started = time.perf_counter()
    started_cpu = time.process_time()
    while pending or core.has_work():
        while pending and in_flight < concurrency:
            index, job = pending.pop(0)
            core.add_request(_request(f"r{index}", job))
            in_flight += 1
        for out in core.step().outputs:
            output_tokens += len(out.new_token_ids)
            if out.usage is not None:
                in_flight -= 1
    elapsed = time.perf_counter() - started
    cpu = time.process_time() - started_cpu
    return _rates(output_tokens, elapsed, cpu)


def _rates(output_tokens: int, seconds: float, cpu_seconds: float) -> dict[str, float]:
    """Wall-clock figures, and the same per CPU second of this process: on a shared machine
    the CPU figure is the steadier one (time spent descheduled does not count)."""
    return {
        "output_tokens_per_s": output_tokens / seconds,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "output_tokens_per_cpu_s": output_tokens / cpu_seconds,
    }


def _kvplane_ttft(
    runner: TorchModelRunner, settings: EngineBenchSettings, rng: random.Random
) -> dict[str, float]:
    vocab = runner.vocab_size
    prompt = tuple(rng.randrange(4, vocab) for _ in range(settings.ttft_prompt_tokens))
    job = _Job(prompt=prompt, max_tokens=1)
    cold: list[float] = []
    cached: list[float] = []
    for round_index in range(settings.ttft_rounds):
        core = _new_core(runner, settings, max_seqs=1)
        for label, samples in (("cold", cold), ("cached", cached)):
            started = time.perf_counter()
            core.add_request(_request(f"ttft-{round_index}-{label}", job))
            first = None
            while core.has_work():
                outputs = core.step().outputs
                if first is None and any(o.new_token_ids for o in outputs):
                    first = time.perf_counter() - started
            samples.append(first if first is not None else float("nan"))
    cold_ms = statistics.median(cold) * 1000
    cached_ms = statistics.median(cached) * 1000
    return {
        "prompt_tokens": float(settings.ttft_prompt_tokens),
        "cold_ms": cold_ms,
        "cached_ms": cached_ms,
        "speedup": cold_ms / cached_ms,
    }


def _hf_throughput(
    model_dir: Path, workloads: dict[int, list[_Job]], settings: EngineBenchSettings
) -> dict[str, Any] | None:
    try:  # a dev dependency, not a runtime one (imported by name: mypy stays off it)
        transformers = importlib.import_module("transformers")
    except ImportError:
        return None
    import torch

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[settings.dtype]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    model = model.to(settings.device).eval()
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    result: dict[str, Any] = {"version": transformers.__version__}
    for concurrency, jobs in workloads.items():
        useful = 0
        started = time.perf_counter()
        started_cpu = time.process_time()
        for first in range(0, len(jobs), concurrency):
            batch = jobs[first : first + concurrency]
            width = max(len(j.prompt) for j in batch)
            ids = torch.full((len(batch), width), pad_id, dtype=torch.int64)
            mask = torch.zeros((len(batch), width), dtype=torch.int64)
            for row, job in enumerate(batch):  # left padding
                ids[row, width - len(job.prompt) :] = torch.tensor(job.prompt)
                mask[row, width - len(job.prompt) :] = 1
            new_tokens = max(j.max_tokens for j in batch)
            with torch.inference_mode():
                model.generate(
                    input_ids=ids.to(settings.device),
                    attention_mask=mask.to(settings.device),
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    do_sample=False,
                    use_cache=True,
                    pad_token_id=pad_id,
                )
            useful += sum(j.max_tokens for j in batch)
        elapsed = time.perf_counter() - started
        cpu = time.process_time() - started_cpu
        result[f"c{concurrency}"] = _rates(useful, elapsed, cpu)
    return result


def random_llama_shape(model: str) -> tuple[int, int] | None:
    """(layers, hidden size) of a `random-LxH` model name, None for any other name; raises
    KvplaneError when L or H is not a positive integer."""
    if not model.startswith("random-"):
        return None
    try:
        layers, hidden = (int(x) for x in model.removeprefix("random-").split("x"))
    except ValueError:
        layers = hidden = 0
    if layers < 1 or hidden < 1:
        raise KvplaneError(f"expected random-LAYERSxHIDDEN (positive integers), got {model!r}")
    return layers, hidden


def check_model(model: str) -> None:
    """A `--model` value: `random-LxH` or a model directory (one holding config.json);
    KvplaneError otherwise, said before anything is written, loaded or started."""
    if random_llama_shape(model) is None and not (Path(model) / "config.json").is_file():
        raise KvplaneError(f"{model!r} is not a model directory (no config.json)")


def resolve_model(model: str, scratch: Path) -> Path:
    """The checkpoint directory of a `check_model`-valid `--model` value: a random one is
    written under `scratch`."""
    check_model(model)
    shape = random_llama_shape(model)
    if shape is not None:
        return write_random_llama(scratch / model, num_layers=shape[0], hidden_size=shape[1])
    return Path(model)


def run_engine_bench(model: str, settings: EngineBenchSettings) -> dict[str, Any]:
    """The benchmark's JSON document."""
    from engine.torch_runner.runner import TorchModelRunner

    with tempfile.TemporaryDirectory(prefix="kvplane-bench-") as scratch:
        model_dir = resolve_model(model, Path(scratch))
        runner = TorchModelRunner.from_pretrained(
            model_dir,
            dtype=settings.dtype,
            device=settings.device,
            block_size=settings.block_size,
            num_blocks=settings.num_blocks,
            seed=settings.seed,
            num_threads=settings.threads,
        )
        import torch

        cfg = runner.model.config
        # The TTFT prompt must fit the model, said before minutes of throughput runs.
        ttft_job = _Job(prompt=(4,) * settings.ttft_prompt_tokens, max_tokens=1)
        _new_core(runner, settings, max_seqs=1).check_request(_request("ttft-check", ttft_job))
        rng = random.Random(settings.seed)
        workloads = {
            c: _jobs(max(4, 2 * c), cfg.vocab_size, settings, rng) for c in settings.concurrency
        }
        # Warm-up: first-call allocations and kernel selection stay out of the figures.
        _kvplane_throughput(runner, _jobs(2, cfg.vocab_size, settings, rng), 2, settings)
        kvplane: dict[str, Any] = {}
        for concurrency, jobs in workloads.items():
            kvplane[f"c{concurrency}"] = _kvplane_throughput(runner, jobs, concurrency, settings)
            log.info("kvplane c=%d: %s", concurrency, kvplane[f"c{concurrency}"])
        kvplane["ttft"] = _kvplane_ttft(runner, settings, rng)
        hf = _hf_throughput(model_dir, workloads, settings) if settings.compare_hf else None
        hf_absent = "not installed" if settings.compare_hf else "skipped (--no-compare-hf)"
        doc: dict[str, Any] = {
            "model": model,
            "parameters": sum(p.numel() for p in _weights(runner)),
            "settings": asdict(settings),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "kvplane": kvplane,
            "hf_transformers": hf if hf is not None else hf_absent,
        }
        if hf is not None:
            for key, rate in (
                ("speedup_vs_hf", "output_tokens_per_s"),
                ("speedup_vs_hf_cpu", "output_tokens_per_cpu_s"),
            ):
                doc[key] = {
                    f"c{c}": kvplane[f"c{c}"][rate] / hf[f"c{c}"][rate]
                    for c in settings.concurrency
                }
        return doc


def _weights(runner: TorchModelRunner) -> list[Any]:
    w = runner.model.weights
    tensors = [w.embed_tokens, w.final_norm]
    if w.lm_head is not None and w.lm_head is not w.embed_tokens:
        tensors.append(w.lm_head)
    for layer in w.layers:
        tensors.extend(
            t
            for t in (
                layer.input_norm,
                layer.qkv_weight,
                layer.qkv_bias,
                layer.o_weight,
                layer.o_bias,
                layer.post_attention_norm,
                layer.gate_up_weight,
                layer.gate_up_bias,
                layer.down_weight,
                layer.down_bias,
            )
            if t is not None
        )
    return tensors


def render_table(doc: dict[str, Any]) -> str:
    lines = [
        f"model {doc['model']} ({doc['parameters']:,} parameters), {doc['torch_threads']} threads"
    ]
    hf = doc["hf_transformers"]
    for c in doc["settings"]["concurrency"]:
        ours = doc["kvplane"][f"c{c}"]["output_tokens_per_s"]
        line = f"  c={c:<3} kvplane {ours:9.1f} tok/s"
        if isinstance(hf, dict):
            theirs = hf[f"c{c}"]["output_tokens_per_s"]
            line += f"   HF generate {theirs:9.1f} tok/s   x{ours / theirs:.2f}"
            ours_cpu = doc["kvplane"][f"c{c}"]["output_tokens_per_cpu_s"]
            theirs_cpu = hf[f"c{c}"]["output_tokens_per_cpu_s"]
            line += f"   (per CPU second: x{ours_cpu / theirs_cpu:.2f})"
        lines.append(line)
    ttft = doc["kvplane"]["ttft"]
    lines.append(
        f"  TTFT {int(ttft['prompt_tokens'])} tokens: cold {ttft['cold_ms']:.1f} ms, "
        f"prefix-cached {ttft['cached_ms']:.1f} ms (x{ttft['speedup']:.1f})"
    )
    if not isinstance(hf, dict):
        lines.append(f"  HF transformers: {hf} (kvplane figures alone)")
    return "\n".join(lines)


def _concurrency_levels(text: str) -> tuple[int, ...]:
    """`--concurrency`: comma-separated positive integers, at least one (a usage error
    otherwise: a count of 0 would never admit a request)."""
    try:
        levels = tuple(int(c) for c in text.split(",") if c.strip())
    except ValueError:
        levels = ()
    if not levels or min(levels) < 1:
        raise typer.BadParameter(
            f"expected comma-separated positive integers, got {text!r}", param_hint="--concurrency"
        )
    return levels


def bench_engine(
    *,
    model: Annotated[
        str, typer.Option(help="HF model directory, or random-LxH (e.g. random-8x512).")
    ],
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16.")] = "float32",
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    concurrency: Annotated[str, typer.Option(help="Comma-separated in-flight counts.")] = "1,8,32",
    threads: Annotated[
        int | None, typer.Option(min=1, help="torch intra-op threads (default: torch's).")
    ] = None,
    ttft_prompt_tokens: Annotated[
        int, typer.Option(min=1, help="Tokens of the prompt whose TTFT is timed cold and cached.")
    ] = 1024,
    compare_hf: Annotated[bool, typer.Option(help="Also run HF generate if installed.")] = True,
    output: OutputOption = OutputFormat.table,
) -> None:
    """The torch engine: output tokens/s at several concurrencies, TTFT cold vs cached."""
    settings = EngineBenchSettings(
        dtype=dtype,
        device=device,
        concurrency=_concurrency_levels(concurrency),
        threads=threads,
        ttft_prompt_tokens=ttft_prompt_tokens,
        compare_hf=compare_hf,
    )
    check_arguments(model, dtype, device)
    emit(run_engine_bench(model, settings), output, render_table)


def check_arguments(model: str, dtype: str, device: str = "cpu") -> None:
    """The `--model`, `--dtype` and `--device` of a torch benchmark (this one, `bench
    handoff`): a usage error for a malformed or missing model, an unknown dtype or a device
    this machine does not have, before any model is built."""
    from engine.torch_runner.loader import resolve_device, resolve_dtype  # imports torch

    with usage_error_for("--model"):
        check_model(model)
    with usage_error_for("--dtype"):
        resolve_dtype(dtype)
    with usage_error_for("--device"):
        resolve_device(device)
