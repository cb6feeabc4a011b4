"""Read a Hugging Face `config.json` for the decoder families the torch runner implements.

Contract: `ModelConfig.from_dir(path)` returns a frozen description of a `LlamaForCausalLM` or
`Qwen2ForCausalLM` checkpoint (or their `*ForSequenceClassification` variants: the same decoder
with a classification head, `classifier_labels` from `id2label`), or raises `CheckpointError`
naming what is missing or unsupported.
Anything that would silently change the numerics (an activation other than SiLU, a RoPE scaling
we do not implement, Qwen2's sliding window) is refused rather than ignored. torch-free.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from engine.torch_runner.errors import CheckpointError


class Architecture(Enum):
    LLAMA = "LlamaForCausalLM"
    QWEN2 = "Qwen2ForCausalLM"


# The same decoders with a classification head (`score.weight`) instead of a causal LM's.
_CLASSIFIERS = {
    "LlamaForSequenceClassification": Architecture.LLAMA,
    "Qwen2ForSequenceClassification": Architecture.QWEN2,
}


class RopeType(Enum):
    DEFAULT = "default"
    LINEAR = "linear"
    LLAMA3 = "llama3"


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float
    type: RopeType = RopeType.DEFAULT
    factor: float = 1.0
    # Only for LLAMA3 scaling.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: Architecture
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    # Biases on q/k/v projections (Qwen2 always; Llama when attention_bias).
    qkv_bias: bool
    # Bias on the output projection (Llama attention_bias only; Qwen2 never).
    o_bias: bool
    mlp_bias: bool
    eos_token_ids: tuple[int, ...]
    # A *ForSequenceClassification checkpoint's labels, in the head's row order; else None.
    classifier_labels: tuple[str, ...] | None = None

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        raw = read_json_object(model_dir / "config.json", required=True)
        if raw is None:  # unreachable: required files raise instead
            raise CheckpointError(f"{model_dir / 'config.json'} not found")
        generation = read_json_object(model_dir / "generation_config.json", required=False)
        return cls.from_dict(raw, generation)

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        architecture, is_classifier = _architecture(raw)
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise CheckpointError(f"hidden_act {act!r} is not supported (only 'silu')")
        if architecture is Architecture.QWEN2 and raw.get("use_sliding_window", False):
            raise CheckpointError("Qwen2 sliding-window attention is not supported")
        hidden_size = _int(raw, "hidden_size")
        num_heads = _int(raw, "num_attention_heads")
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads != 0:
            raise CheckpointError(
                f"num_attention_heads {num_heads} is not a multiple of "
                f"num_key_value_heads {num_kv_heads}"
            )
        head_dim = int(raw.get("head_dim") or hidden_size // num_heads)
        if head_dim % 2 != 0:
            raise CheckpointError(f"head_dim {head_dim} must be even for rotary embeddings")
        attention_bias = bool(raw.get("attention_bias", False))
        qwen2 = architecture is Architecture.QWEN2
        return cls(
            architecture=architecture,
            vocab_size=_int(raw, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_int(raw, "intermediate_size"),
            num_layers=_int(raw, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=_rope(raw),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=True if qwen2 else attention_bias,
            o_bias=False if qwen2 else attention_bias,
            mlp_bias=False if qwen2 else bool(raw.get("mlp_bias", False)),
            eos_token_ids=_eos_ids(raw, generation),
            classifier_labels=_labels(raw) if is_classifier else None,
        )


def read_json_object(path: Path, *, required: bool) -> dict[str, Any] | None:
    """The JSON object in `path` (None: no such file, and not `required`); CheckpointError
    naming the file when it cannot be read, is not JSON or holds something else."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        if required:
            raise CheckpointError(f"{path} not found: not a Hugging Face model directory") from None
        return None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return value


def _architecture(raw: dict[str, Any]) -> tuple[Architecture, bool]:
    """The decoder family, and whether the checkpoint is a sequence classifier."""
    names = raw.get("architectures") or []
    for name in names:
        for arch in Architecture:
            if arch.value == name:
                return arch, False
        if name in _CLASSIFIERS:
            return _CLASSIFIERS[name], True
    model_type = raw.get("model_type")
    if not names and model_type in ("llama", "qwen2"):
        return (Architecture.LLAMA if model_type == "llama" else Architecture.QWEN2), False
    supported = ", ".join([*(a.value for a in Architecture), *_CLASSIFIERS])
    raise CheckpointError(
        f"unsupported architecture {names or model_type!r}; supported: {supported}"
    )


def _labels(raw: dict[str, Any]) -> tuple[str, ...]:
    """`id2label` in id order (HF's defaults `LABEL_i` when only `num_labels` is given)."""
    id2label = raw.get("id2label")
    if isinstance(id2label, dict) and id2label:
        try:
            by_id = {int(k): str(v) for k, v in id2label.items()}
        except ValueError:
            raise CheckpointError("config.json: id2label keys must be integers") from None
        if sorted(by_id) != list(range(len(by_id))):
            raise CheckpointError("config.json: id2label must number labels 0 .. n-1")
        return tuple(by_id[i] for i in range(len(by_id)))
    num_labels = raw.get("num_labels", 2)  # HF's PretrainedConfig default
    if not isinstance(num_labels, int) or isinstance(num_labels, bool) or num_labels <= 0:
        raise CheckpointError(f"config.json: num_labels must be positive, got {num_labels!r}")
    return tuple(f"LABEL_{i}" for i in range(num_labels))


def _int(raw: dict[str, Any], key: str) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise CheckpointError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


def _ids(value: object) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int) and not isinstance(v, bool))
    return ()


def _eos_ids(raw: dict[str, Any], generation: dict[str, Any] | None) -> tuple[int, ...]:
    # generation_config.json wins: it is what `generate` and vLLM use as the stop set.
    if generation is not None:
        ids = _ids(generation.get("eos_token_id"))
        if ids:
            return ids
    return _ids(raw.get("eos_token_id"))


def _rope(raw: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 nests theta and scaling in "rope_parameters"; older files use
    # top-level "rope_theta" and "rope_scaling".
    params = raw.get("rope_parameters")
    scaling: dict[str, Any] | None
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
        scaling = params
    else:
        theta = float(raw.get("rope_theta", 10000.0))
        scaling = raw.get("rope_scaling")
    if not scaling:
        return RopeConfig(theta=theta)
    type_name = scaling.get("rope_type") or scaling.get("type") or "default"
    try:
        rope_type = RopeType(type_name)
    except ValueError:
        raise CheckpointError(f"rope scaling {type_name!r} is not supported") from None
    if rope_type is RopeType.DEFAULT:
        return RopeConfig(theta=theta)
    factor = float(scaling.get("factor", 1.0))
    if rope_type is RopeType.LINEAR:
        return RopeConfig(theta=theta, type=rope_type, factor=factor)
    return RopeConfig(
        theta=theta,
        type=rope_type,
        factor=factor,
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
    )
