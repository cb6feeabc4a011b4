"""A checkpoint's own sampling defaults: the sampling values of its `generation_config.json`.

Contract: `sampling_defaults(model_dir)` returns the `SamplingDefaults` (engine.core.api) that
the file sets, or none when there is no file (the builtin and sim models: the front ends'
fixed defaults stay), or raises `CheckpointError` naming the file and the key when a value is
not a number of the right kind or out of range, so a bad file stops the engine at start
instead of failing every request that leaves the option unset. torch-free.

The keys are those vLLM reads with its default `--generation-config auto`: `temperature`,
`top_p`, `top_k`, `min_p`, `repetition_penalty`, and `max_new_tokens` (the default
`max_tokens`). A key set to null is not set. `top_k` 0 or -1 is HF's and vLLM's "no top-k".
`do_sample` is not read: vLLM does not read it either, so a file with `do_sample: false` and
a temperature of 0.6 samples at 0.6. Everything else in the file (`max_length`, beam search,
`no_repeat_ngram_size`, ...) is ignored, as vLLM ignores it; the EOS ids are
`ModelConfig`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.core.api import SamplingDefaults, SamplingParams
from engine.core.errors import InvalidRequestError
from engine.torch_runner.config import read_json_object
from engine.torch_runner.errors import CheckpointError

GENERATION_CONFIG_FILE = "generation_config.json"

# HF's and vLLM's spellings of "no top-k".
_NO_TOP_K = (0, -1)


def sampling_defaults(model_dir: Path) -> SamplingDefaults:
    path = model_dir / GENERATION_CONFIG_FILE
    raw = read_json_object(path, required=False)
    if raw is None:
        return SamplingDefaults()
    try:
        defaults = _parse(raw)
        # The ranges are those of a request's own values: one rule for both.
        defaults.over(SamplingParams()).validate()
    except InvalidRequestError as exc:
        raise CheckpointError(
            f"{path}: {exc} (its sampling values are this engine's defaults: fix the file, "
            "or set generation_config: none to ignore them)"
        ) from None
    return defaults


def _parse(raw: dict[str, Any]) -> SamplingDefaults:
    """The values set, typed; InvalidRequestError (as a request's own bad value) otherwise."""
    top_k = _integer(raw, "top_k")
    max_new_tokens = _integer(raw, "max_new_tokens")
    if max_new_tokens is not None and max_new_tokens < 1:
        # Checked here: the request's own check would name `max_tokens`, not this key.
        raise InvalidRequestError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    return SamplingDefaults(
        temperature=_number(raw, "temperature"),
        top_p=_number(raw, "top_p"),
        top_k=None if top_k in _NO_TOP_K else top_k,
        min_p=_number(raw, "min_p"),
        repetition_penalty=_number(raw, "repetition_penalty"),
        max_tokens=max_new_tokens,
    )


def _number(raw: dict[str, Any], key: str) -> float | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequestError(f"{key} must be a number, got {value!r}")
    return float(value)


def _integer(raw: dict[str, Any], key: str) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{key} must be an integer, got {value!r}")
    return value
