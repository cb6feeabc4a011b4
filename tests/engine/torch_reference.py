"""Test helpers for the torch runner: a dense float64 reference decoder written independently of
`engine.torch_runner` (straight from the HF tensor names), a tiny random Qwen2 checkpoint, and a
minimal driver that feeds a TorchModelRunner scheduled batches the way the engine core does."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine.core.api import (
    LogprobRequest,
    SamplingParams,
    ScheduledBatch,
    ScheduledSequence,
    SequenceResult,
)
from engine.torch_runner.runner import TorchModelRunner

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"
TINY_LLAMA = SHARED / "models" / "tiny-llama"
VLLM_REQUESTS = SHARED / "data" / "vllm-0.32.0-kv-events" / "requests.jsonl"
# Where the tests that name it run the model: "cpu" here and in CI; KVPLANE_TEST_DEVICE=cuda runs
# them on a GPU (docs/benchmarks/engine.md, "On a GPU").
TEST_DEVICE = os.environ.get("KVPLANE_TEST_DEVICE", "cpu")


def vllm_requests() -> list[dict[str, Any]]:
    lines = VLLM_REQUESTS.read_text().splitlines()
    return [r for r in map(json.loads, lines) if "req_seq" in r]


def dense_logits(model_dir: Path, token_ids: Sequence[int]) -> torch.Tensor:
    """float64 logits [T, V] of a whole sequence: full causal attention, no cache, no fusion."""
    config = json.loads((model_dir / "config.json").read_text())
    w = _float64_state(model_dir)
    head = (
        w["model.embed_tokens.weight"] if config.get("tie_word_embeddings") else w["lm_head.weight"]
    )
    return dense_hidden(model_dir, token_ids) @ head.T


def _float64_state(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in model_dir.glob("*.safetensors"):
        state.update(load_file(str(file)))
    return {k: v.double() for k, v in state.items()}


def dense_hidden(model_dir: Path, token_ids: Sequence[int]) -> torch.Tensor:
    """float64 final hidden states [T, hidden] (after the final norm, before any head) of a
    whole sequence: full causal attention, no cache, no fusion."""
    config = json.loads((model_dir / "config.json").read_text())
    w = _float64_state(model_dir)
    hidden_size = config["hidden_size"]
    n_heads = config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads", n_heads)
    head_dim = config.get("head_dim") or hidden_size // n_heads
    eps = config["rms_norm_eps"]
    theta = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta"))
    positions = torch.arange(len(token_ids), dtype=torch.float64)
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.cat([torch.outer(positions, inv_freq)] * 2, dim=-1)  # [T, D]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    def linear(x: torch.Tensor, name: str) -> torch.Tensor:
        y = x @ w[name + ".weight"].T
        return y + w[name + ".bias"] if name + ".bias" in w else y

    seq_len = len(token_ids)
    x = w["model.embed_tokens.weight"][torch.tensor(list(token_ids))]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = norm(x, w[p + "input_layernorm.weight"])
        q = rotate(linear(h, p + "self_attn.q_proj").view(seq_len, n_heads, head_dim))
        k = rotate(linear(h, p + "self_attn.k_proj").view(seq_len, n_kv, head_dim))
        v = linear(h, p + "self_attn.v_proj").view(seq_len, n_kv, head_dim)
        k = k.repeat_interleave(n_heads // n_kv, dim=1)
        v = v.repeat_interleave(n_heads // n_kv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / head_dim**0.5
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        attn = torch.einsum("hqk,khd->qhd", probs, v).reshape(seq_len, n_heads * head_dim)
        x = x + linear(attn, p + "self_attn.o_proj")
        h = norm(x, w[p + "post_attention_layernorm.weight"])
        gate = linear(h, p + "mlp.gate_proj")
        x = x + linear(
            gate * torch.sigmoid(gate) * linear(h, p + "mlp.up_proj"), p + "mlp.down_proj"
        )
    return norm(x, w["model.norm.weight"])


def write_random_qwen2(directory: Path, seed: int = 1234) -> Path:
    """A tiny Qwen2ForCausalLM: GQA (4 heads, 2 KV heads), tied embeddings, q/k/v biases,
    non-trivial norm weights, rope theta 1e6. Random weights with a fixed seed."""
    g = torch.Generator().manual_seed(seed)
    hidden, inter, vocab, heads, kv_heads, head_dim, layers = 64, 160, 300, 4, 2, 16, 2

    def randn(*shape: int, std: float = 0.08) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    state: dict[str, torch.Tensor] = {"model.embed_tokens.weight": randn(vocab, hidden, std=0.5)}
    for i in range(layers):
        p = f"model.layers.{i}."
        state |= {
            p + "input_layernorm.weight": 1 + randn(hidden, std=0.2),
            p + "post_attention_layernorm.weight": 1 + randn(hidden, std=0.2),
            p + "self_attn.q_proj.weight": randn(heads * head_dim, hidden, std=0.2),
            p + "self_attn.q_proj.bias": randn(heads * head_dim, std=0.5),
            p + "self_attn.k_proj.weight": randn(kv_heads * head_dim, hidden, std=0.2),
            p + "self_attn.k_proj.bias": randn(kv_heads * head_dim, std=0.5),
            p + "self_attn.v_proj.weight": randn(kv_heads * head_dim, hidden, std=0.2),
            p + "self_attn.v_proj.bias": randn(kv_heads * head_dim, std=0.5),
            p + "self_attn.o_proj.weight": randn(hidden, heads * head_dim, std=0.2),
            p + "mlp.gate_proj.weight": randn(inter, hidden, std=0.2),
            p + "mlp.up_proj.weight": randn(inter, hidden, std=0.2),
            p + "mlp.down_proj.weight": randn(hidden, inter, std=0.2),
        }
    state["model.norm.weight"] = 1 + randn(hidden, std=0.2)
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "use_sliding_window": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(state, str(directory / "model.safetensors"))
    return directory


@dataclass
class DrivenSequence:
    """A sequence driven through a runner by `drive`: prompt, outputs, block table."""

    seq_id: int
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    seed: int | None = None
    prompt_logprobs: LogprobRequest | None = None
    block_table: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    results: list[SequenceResult] = field(default_factory=list)
    num_computed: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.outputs

    @property
    def done(self) -> bool:
        return len(self.outputs) >= self.max_tokens


def vllm_sequences(
    requests: list[dict[str, Any]], logprobs: LogprobRequest | None = None
) -> list[DrivenSequence]:
    """One greedy DrivenSequence per recorded vLLM request, as long as vLLM's output."""
    greedy = SamplingParams(temperature=0.0, logprobs=logprobs)
    return [
        DrivenSequence(
            seq_id=i,
            prompt=r["prompt_token_ids"],
            max_tokens=len(r["output_token_ids"]),
            sampling=greedy,
        )
        for i, r in enumerate(requests)
    ]


def drive(
    runner: TorchModelRunner, sequences: list[DrivenSequence], chunk_tokens: int = 64
) -> None:
    """Run every sequence to max_tokens together: chunked prefill (at most `chunk_tokens` per
    sequence per step) mixed with decodes, each sequence on its own blocks."""
    block_size = runner.block_size
    next_block = 0
    for seq in sequences:
        needed = -(-(len(seq.prompt) + seq.max_tokens) // block_size)
        seq.block_table = list(range(next_block, next_block + needed))
        next_block += needed
    assert next_block <= runner.num_blocks, "test cache too small"
    while not all(s.done for s in sequences):
        scheduled = []
        for seq in sequences:
            if seq.done:
                continue
            tokens = seq.tokens
            chunk = tokens[seq.num_computed : seq.num_computed + chunk_tokens]
            scheduled.append(
                ScheduledSequence(
                    seq_id=seq.seq_id,
                    request_id=str(seq.seq_id),
                    output_index=0,
                    token_ids=chunk,
                    start_position=seq.num_computed,
                    block_table=seq.block_table,
                    sample=seq.num_computed + len(chunk) == len(tokens),
                    sampling=seq.sampling,
                    seed=seq.seed,
                    prompt_token_ids=seq.prompt,
                    output_token_ids=list(seq.outputs),
                    prompt_logprobs=seq.prompt_logprobs,
                )
            )
        batch = ScheduledBatch(
            sequences=tuple(scheduled),
            num_scheduled_tokens=sum(len(s.token_ids) for s in scheduled),
            num_prefill_tokens=0,
            num_decode_sequences=0,
            num_decode_context_tokens=0,
        )
        by_id = {s.seq_id: s for s in sequences}
        for result in runner.execute(batch):
            seq = by_id[result.seq_id]
            step = next(s for s in scheduled if s.seq_id == result.seq_id)
            seq.num_computed += len(step.token_ids)
            seq.results.append(result)
            if result.token_id is not None:
                seq.outputs.append(result.token_id)
