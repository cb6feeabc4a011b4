"""Test helpers: small random PEFT LoRA adapters written by hand (adapter_config.json +
adapter_model.safetensors with PEFT's tensor names), and a copy of a model directory with an
adapter merged into its weights (W + scaling * B @ A), the reference LoRA output must equal.
Not a test module itself."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PARENT = {m: "self_attn" if m in ALL_MODULES[:4] else "mlp" for m in ALL_MODULES}


def write_adapter_config(directory: Path, **overrides: Any) -> Path:
    """A PEFT LoRA adapter_config.json (r 8, alpha 16, every module unless overridden)."""
    directory.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": 8,
        "lora_alpha": 16,
        "lora_dropout": 0.0,
        "target_modules": list(ALL_MODULES),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "rank_pattern": {},
        "alpha_pattern": {},
        "modules_to_save": None,
    }
    config.update(overrides)
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def module_shapes(model_dir: Path) -> dict[str, tuple[int, int]]:
    """module -> (in features, out features), from the base model's config.json."""
    raw = json.loads((model_dir / "config.json").read_text())
    hidden, inter = raw["hidden_size"], raw["intermediate_size"]
    head_dim = raw.get("head_dim") or hidden // raw["num_attention_heads"]
    q_size = raw["num_attention_heads"] * head_dim
    kv_size = raw["num_key_value_heads"] * head_dim
    return {
        "q_proj": (hidden, q_size),
        "k_proj": (hidden, kv_size),
        "v_proj": (hidden, kv_size),
        "o_proj": (q_size, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def write_adapter(
    directory: Path,
    model_dir: Path,
    *,
    rank: int = 8,
    alpha: float = 16,
    modules: tuple[str, ...] = ALL_MODULES,
    seed: int = 0,
    b_scale: float = 0.05,
    use_rslora: bool = False,
    shapes: dict[str, tuple[int, int]] | None = None,
) -> Path:
    """A random adapter for `model_dir` (PEFT's names; B non-zero so that it changes the
    output). `shapes` overrides the (in, out) sizes, to write a mismatched adapter."""
    write_adapter_config(
        directory, r=rank, lora_alpha=alpha, target_modules=list(modules), use_rslora=use_rslora
    )
    shapes = shapes or module_shapes(model_dir)
    num_layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(num_layers):
        for module in modules:
            in_features, out_features = shapes[module]
            name = f"base_model.model.model.layers.{layer}.{_PARENT[module]}.{module}"
            a = torch.randn(rank, in_features, generator=generator) / math.sqrt(in_features)
            b = torch.randn(out_features, rank, generator=generator) * b_scale
            tensors[f"{name}.lora_A.weight"] = a
            tensors[f"{name}.lora_B.weight"] = b
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


def merged_model(model_dir: Path, adapter_dir: Path, out_dir: Path) -> Path:
    """A copy of `model_dir` whose weights have the adapter merged in, computed in float64."""
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    rank = config["r"]
    scaling = config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)
    shutil.copytree(model_dir, out_dir)
    weights_file = next(out_dir.glob("*.safetensors"))
    state = load_file(str(weights_file))
    adapter = load_file(str(adapter_dir / "adapter_model.safetensors"))
    for key, a in adapter.items():
        if ".lora_A." not in key:
            continue
        b = adapter[key.replace(".lora_A.", ".lora_B.")]
        base = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        merged = state[base].double() + scaling * (b.double() @ a.double())
        state[base] = merged.to(state[base].dtype)
    save_file(state, str(weights_file))
    return out_dir
