"""LoRA adapters for the torch decoder: reading a PEFT adapter, checking it against the base
model, and applying each sequence's adapter in a mixed batch.

Reading (`read_lora`): `adapter_config.json` (`engine.core.lora.read_adapter_config`) and
`adapter_model.safetensors` with PEFT's tensor names for Llama/Qwen2,
`base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight` (A `[r, in]`,
B `[out, r]`). A malformed adapter (an unexpected tensor name, a module its config does not
target, an A without its B, a rank other than `r`) is InvalidLoraError; one that does not fit
the base model (a layer it lacks, other input or output sizes) is LoraMismatchError. Every
message names the tensor and the sizes.

Layout. The decoder's projections are fused (q/k/v in one matmul, gate/up in another), so an
adapter is stored per layer and per fused *site*: A of the site's targeted modules stacked
(`[k * r, in]`), and their B, times PEFT's scaling, placed block-diagonally in the site's
output slices (`[out, k * r]`, zero elsewhere). A site then costs two small matmuls,
`y += (x A^T) B^T`, which is `x (W + scaling * B A)^T` minus `x W^T`: the merged weight's
output, without merging (the base weights stay shared by every adapter and by no adapter).

Batching (`LoraBatch`): per step, the token rows of each adapter's sequences (one slice when
contiguous, else an index); rows without an adapter are left alone.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file

from engine.core.api import ScheduledSequence
from engine.core.errors import InvalidLoraError, LoraMismatchError
from engine.core.lora import ADAPTER_WEIGHTS, AdapterConfig, read_adapter_config
from engine.torch_runner.config import ModelConfig


class Site(IntEnum):
    """The fused linear layers of a decoder layer."""

    QKV = 0
    O_PROJ = 1
    GATE_UP = 2
    DOWN = 3


# module -> (its site, its parent in PEFT's names)
_MODULES: dict[str, tuple[Site, str]] = {
    "q_proj": (Site.QKV, "self_attn"),
    "k_proj": (Site.QKV, "self_attn"),
    "v_proj": (Site.QKV, "self_attn"),
    "o_proj": (Site.O_PROJ, "self_attn"),
    "gate_proj": (Site.GATE_UP, "mlp"),
    "up_proj": (Site.GATE_UP, "mlp"),
    "down_proj": (Site.DOWN, "mlp"),
}
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])(?:\.default)?"
    r"\.weight$"
)
# Any PEFT LoRA weight (of a module _KEY does not know, e.g. the LM head): group 1 its module.
# Only weights: another tensor of a module (`lora_B.bias`, PEFT's lora_bias) is unexpected.
_ANY_LORA_KEY = re.compile(
    r"^(?:base_model\.model\.)?(.+)\.(?:lora_[AB](?:\.default)?\.weight|lora_embedding_[AB]"
    r"(?:\.default)?)$"
)


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int, int]]:
    """module -> (in features, out features, offset of its output in the fused site)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    return {
        "q_proj": (hidden, q_size, 0),
        "k_proj": (hidden, kv_size, q_size),
        "v_proj": (hidden, kv_size, q_size + kv_size),
        "o_proj": (q_size, hidden, 0),
        "gate_proj": (hidden, inter, 0),
        "up_proj": (hidden, inter, inter),
        "down_proj": (inter, hidden, 0),
    }


def _site_out(config: ModelConfig, site: Site) -> int:
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    return {
        Site.QKV: q_size + 2 * kv_size,
        Site.O_PROJ: config.hidden_size,
        Site.GATE_UP: 2 * config.intermediate_size,
        Site.DOWN: config.hidden_size,
    }[site]


@dataclass(frozen=True, slots=True)
class SiteWeights:
    a: torch.Tensor  # [k * r, in]: A of the site's targeted modules, stacked
    b: torch.Tensor  # [out, k * r]: their B times the scaling, block-diagonal


@dataclass(frozen=True, slots=True)
class LoraWeights:
    config: AdapterConfig
    layers: tuple[tuple[SiteWeights | None, ...], ...]  # [layer][Site]


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    file = path / ADAPTER_WEIGHTS
    if not file.is_file():
        raise InvalidLoraError(f"{file} does not exist (kvplane reads safetensors adapters)")
    try:
        return load_file(str(file), device="cpu")
    except (SafetensorError, OSError) as exc:
        raise InvalidLoraError(f"cannot read {file}: {exc}") from exc


def _pairs(
    tensors: Mapping[str, torch.Tensor], config: AdapterConfig, model: ModelConfig
) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """(layer, module) -> {"A": tensor, "B": tensor}, every name checked."""
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None and (other := _ANY_LORA_KEY.match(key)) is not None:
            raise LoraMismatchError(
                f"tensor {key!r} adapts {other[1]}, which this engine does not adapt"
            )
        if match is None:
            raise InvalidLoraError(f"unexpected tensor {key!r} in the adapter (not a LoRA A/B)")
        layer, parent, module, which = int(match[1]), match[2], match[3], match[4]
        if module not in _MODULES or _MODULES[module][1] != parent:
            raise LoraMismatchError(
                f"tensor {key!r} adapts {parent}.{module}, which this engine does not adapt"
            )
        if not config.target_modules.targets(f"model.layers.{layer}.{parent}.{module}"):
            raise InvalidLoraError(
                f"tensor {key!r} adapts {module}, which target_modules does not list"
            )
        if layer >= model.num_layers:
            raise LoraMismatchError(
                f"tensor {key!r} is for layer {layer}; the base model has {model.num_layers}"
            )
        pairs.setdefault((layer, module), {})[which] = tensor
    if not pairs:
        raise InvalidLoraError("the adapter holds no LoRA weights")
    for (layer, module), pair in pairs.items():
        if set(pair) != {"A", "B"}:
            missing = "B" if "A" in pair else "A"
            raise InvalidLoraError(f"layer {layer} {module}: lora_{missing} is missing")
    return pairs


def _check_shapes(
    where: str, a: torch.Tensor, b: torch.Tensor, rank: int, in_out: tuple[int, int]
) -> None:
    if a.dim() != 2 or b.dim() != 2:
        raise InvalidLoraError(f"{where}: lora_A and lora_B must be matrices")
    if a.shape[0] != rank or b.shape[1] != rank:
        raise InvalidLoraError(
            f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not have the "
            f"config's rank r={rank}"
        )
    in_features, out_features = in_out
    if a.shape[1] != in_features or b.shape[0] != out_features:
        raise LoraMismatchError(
            f"{where}: shape mismatch with the base model: lora_A {tuple(a.shape)} needs "
            f"({rank}, {in_features}), lora_B {tuple(b.shape)} needs ({out_features}, {rank})"
        )


def read_lora(
    path: Path, model: ModelConfig, dtype: torch.dtype, device: torch.device, *, max_rank: int
) -> LoraWeights:
    """Read, check and lay out an adapter for `model` (see the module docstring)."""
    config = read_adapter_config(path, max_rank=max_rank)
    pairs = _pairs(_read_tensors(path), config, model)
    shapes = module_shapes(model)
    rank, scaling = config.rank, config.scaling
    layers: list[tuple[SiteWeights | None, ...]] = []
    for layer in range(model.num_layers):
        sites: list[SiteWeights | None] = []
        for site in Site:
            modules = [m for m, (s, _) in _MODULES.items() if s is site and (layer, m) in pairs]
            if not modules:
                sites.append(None)
                continue
            a_parts = []
            b = torch.zeros(_site_out(model, site), rank * len(modules), dtype=torch.float32)
            for j, module in enumerate(modules):
                in_features, out_features, offset = shapes[module]
                a_m, b_m = pairs[layer, module]["A"], pairs[layer, module]["B"]
                _check_shapes(
                    f"layer {layer} {module}", a_m, b_m, rank, (in_features, out_features)
                )
                a_parts.append(a_m.float())
                b[offset : offset + out_features, j * rank : (j + 1) * rank] = b_m.float() * scaling
            a = torch.cat(a_parts).to(device=device, dtype=dtype).contiguous()
            sites.append(SiteWeights(a, b.to(device=device, dtype=dtype).contiguous()))
        layers.append(tuple(sites))
    return LoraWeights(config, tuple(layers))


Rows = slice | torch.Tensor | None  # None: every row of the step


@dataclass(frozen=True, slots=True)
class LoraBatch:
    """The adapters of one step and the token rows each applies to."""

    groups: tuple[tuple[LoraWeights, Rows], ...]

    @classmethod
    def build(
        cls,
        sequences: Sequence[ScheduledSequence],
        adapters: Mapping[str, LoraWeights],
        device: torch.device,
    ) -> LoraBatch | None:
        """None when no sequence of the step names an adapter (`adapters`: by `lora_key`).
        Raises KeyError for an adapter the runner does not hold (the core never schedules
        one)."""
        rows: dict[str, list[int]] = {}
        offset = 0
        for seq in sequences:
            num_tokens = len(seq.token_ids)
            if seq.lora_key is not None:
                rows.setdefault(seq.lora_key, []).extend(range(offset, offset + num_tokens))
            offset += num_tokens
        if not rows:
            return None
        groups: list[tuple[LoraWeights, Rows]] = []
        for key, indices in rows.items():
            selection: Rows
            if len(indices) == offset:
                selection = None
            elif indices[-1] - indices[0] + 1 == len(indices):
                selection = slice(indices[0], indices[-1] + 1)
            else:
                selection = torch.tensor(indices, dtype=torch.int64, device=device)
            groups.append((adapters[key], selection))
        return cls(tuple(groups))

    def apply(self, layer: int, site: Site, x: torch.Tensor, y: torch.Tensor) -> None:
        """`y += (x A^T) B^T` in place, for each adapter's rows (y = the site's base output)."""
        for weights, rows in self.groups:
            w = weights.layers[layer][site]
            if w is None:
                continue
            if rows is None:
                y += F.linear(F.linear(x, w.a), w.b)
            elif isinstance(rows, slice):
                y[rows] += F.linear(F.linear(x[rows], w.a), w.b)
            else:
                y.index_add_(0, rows, F.linear(F.linear(x.index_select(0, rows), w.a), w.b))
