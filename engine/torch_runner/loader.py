"""Load a Hugging Face Llama/Qwen2 checkpoint (config.json + *.safetensors) into a DecoderModel.

Contract: `load_model(path, dtype, device)` returns a ready model or raises `CheckpointError`
naming the missing file, the missing or misshapen tensor, or the unsupported dtype/device.
Tensors are checked against the shapes `config.json` implies before anything is built, so a
mismatched checkpoint fails at load time rather than producing wrong text.

`with_lm_head=False` (a pooling-only engine) loads no LM head: the model cannot produce logits
and `lm_head.weight` need not exist. `ships_lm_head(path)` says, from the config and the
safetensors headers alone (no tensor read), whether the checkpoint has one to load.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from engine.torch_runner.config import ModelConfig
from engine.torch_runner.errors import CheckpointError
from engine.torch_runner.model import DecoderModel, LayerWeights, ModelWeights

_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise CheckpointError(
            f"dtype {name!r} is not supported; choose one of {sorted(_DTYPES)}"
        ) from None


def resolve_device(name: str) -> torch.device:
    """The torch device `name` names, if this machine has it (CheckpointError otherwise)."""
    return check_device(name, torch.cuda.device_count())


def check_device(name: str, num_gpus: int) -> torch.device:
    """The torch device `name` names, on a machine where `num_gpus` CUDA devices are visible;
    CheckpointError saying why it cannot be used otherwise. The count is an argument so that
    the check runs without a GPU; torch itself takes `cuda:N` for any N and fails only when
    the first tensor lands there."""
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise CheckpointError(f"bad device {name!r}: {exc}") from exc
    if device.type == "cuda" and num_gpus == 0:
        raise CheckpointError(
            f"device {name!r} requested but CUDA is not available: no GPU visible"
        )
    if device.type == "cuda" and device.index is not None and device.index >= num_gpus:
        gpus = "cuda:0" if num_gpus == 1 else f"cuda:0 to cuda:{num_gpus - 1}"
        raise CheckpointError(
            f"device {name!r} does not exist: {num_gpus} GPU{'s' if num_gpus > 1 else ''}"
            f" visible ({gpus})"
        )
    if device.type not in ("cpu", "cuda"):
        raise CheckpointError(f"device type {device.type!r} is not supported (cpu or cuda)")
    return device


def read_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            state.update(load_file(str(file), device="cpu"))
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"cannot read {file}: {exc}") from exc
    return state


class _Weights:
    """Takes tensors out of a state dict by name, checking shape, converting dtype/device."""

    def __init__(
        self, state: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device
    ) -> None:
        self._state = state
        self._dtype = dtype
        self._device = device

    def has(self, name: str) -> bool:
        return name in self._state

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        tensor = self._state.get(name)
        if tensor is None:
            raise CheckpointError(f"checkpoint has no tensor {name!r}")
        if tuple(tensor.shape) != shape:
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, config implies {shape}"
            )
        return tensor.to(device=self._device, dtype=self._dtype).contiguous()

    def optional(self, name: str, shape: tuple[int, ...], present: bool) -> torch.Tensor | None:
        return self.get(name, shape) if present else None


def _cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    if all(p is None for p in parts):
        return None
    return torch.cat([p for p in parts if p is not None], dim=0)


def _matmul_layout(weight: torch.Tensor) -> torch.Tensor:
    """A [out, in] projection stored column-major (`weight.t()` contiguous), same values and
    shape: on CPU in float32, `F.linear` then runs MKL's non-transposed GEMM, measured
    bit-identical and 10-20% faster for decode-sized inputs (32 rows: 512 -> 32,000 outputs
    22.2 -> 18.3 ms; 512 -> 2,816 1.34 -> 1.21 ms) and no slower for prefill."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        return weight
    return weight.t().contiguous().t()


def ships_lm_head(model_dir: Path | str) -> bool:
    """Whether the checkpoint can generate: it ties its embeddings or ships `lm_head.weight`."""
    path = Path(model_dir)
    if ModelConfig.from_dir(path).tie_word_embeddings:
        return True
    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as weights:
                if "lm_head.weight" in weights.keys():  # noqa: SIM118 (not a dict)
                    return True
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"cannot read {file}: {exc}") from exc
    return False


def build_weights(
    config: ModelConfig,
    state: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    *,
    with_lm_head: bool = True,
) -> ModelWeights:
    w = _Weights(state, dtype, device)
    hidden, inter = config.hidden_size, config.intermediate_size
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        qkv_bias = config.qkv_bias
        layers.append(
            LayerWeights(
                input_norm=w.get(p + "input_layernorm.weight", (hidden,)),
                qkv_weight=_matmul_layout(
                    torch.cat(
                        [
                            w.get(attn + "q_proj.weight", (q_size, hidden)),
                            w.get(attn + "k_proj.weight", (kv_size, hidden)),
                            w.get(attn + "v_proj.weight", (kv_size, hidden)),
                        ]
                    )
                ),
                qkv_bias=_cat(
                    [
                        w.optional(attn + "q_proj.bias", (q_size,), qkv_bias),
                        w.optional(attn + "k_proj.bias", (kv_size,), qkv_bias),
                        w.optional(attn + "v_proj.bias", (kv_size,), qkv_bias),
                    ]
                ),
                o_weight=_matmul_layout(w.get(attn + "o_proj.weight", (hidden, q_size))),
                o_bias=w.optional(attn + "o_proj.bias", (hidden,), config.o_bias),
                post_attention_norm=w.get(p + "post_attention_layernorm.weight", (hidden,)),
                gate_up_weight=_matmul_layout(
                    torch.cat(
                        [
                            w.get(mlp + "gate_proj.weight", (inter, hidden)),
                            w.get(mlp + "up_proj.weight", (inter, hidden)),
                        ]
                    )
                ),
                gate_up_bias=_cat(
                    [
                        w.optional(mlp + "gate_proj.bias", (inter,), config.mlp_bias),
                        w.optional(mlp + "up_proj.bias", (inter,), config.mlp_bias),
                    ]
                ),
                down_weight=_matmul_layout(w.get(mlp + "down_proj.weight", (hidden, inter))),
                down_bias=w.optional(mlp + "down_proj.bias", (hidden,), config.mlp_bias),
            )
        )
    embed = w.get("model.embed_tokens.weight", (config.vocab_size, hidden))
    # Some tied checkpoints still ship lm_head.weight; tie_word_embeddings decides.
    lm_head: torch.Tensor | None = None
    if not with_lm_head:
        pass  # pooling only: never produces logits
    elif config.tie_word_embeddings:
        lm_head = embed
    else:
        if config.classifier_labels is not None and not w.has("lm_head.weight"):
            raise CheckpointError(
                "this sequence classifier has no lm_head.weight and does not tie its "
                "embeddings: it cannot generate; serve it with runner: pooling (or auto) "
                "for Embed/Classify/Score"
            )
        lm_head = _matmul_layout(w.get("lm_head.weight", (config.vocab_size, hidden)))
    classifier = None
    if config.classifier_labels is not None:
        classifier = w.get("score.weight", (len(config.classifier_labels), hidden))
    return ModelWeights(
        embed_tokens=embed,
        layers=tuple(layers),
        final_norm=w.get("model.norm.weight", (hidden,)),
        lm_head=lm_head,
        classifier=classifier,
    )


def load_model(
    model_dir: Path | str,
    dtype: str = "float32",
    device: str = "cpu",
    *,
    with_lm_head: bool = True,
) -> DecoderModel:
    path = Path(model_dir)
    if not path.is_dir():
        raise CheckpointError(f"model directory {path} does not exist")
    config = ModelConfig.from_dir(path)
    torch_dtype = resolve_dtype(dtype)
    torch_device = resolve_device(device)
    state = read_state_dict(path)
    weights = build_weights(config, state, torch_dtype, torch_device, with_lm_head=with_lm_head)
    return DecoderModel(config, weights, torch_dtype, torch_device)
