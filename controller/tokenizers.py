"""Which tokenizer turns a text prompt into the tokens the router hashes: its model's own
(`tokenizers: {MODEL: tokenizer.json}`), else the controller-wide default (`tokenizer:`), else
none. A request naming no model is tokenised as the fleet's default model (`Controller.plan`),
the model the engine that serves it runs; one naming an alias of a model, as that model
(`Registry.served_name`). `builtin` names the builtin model's tokenizer (what engines serving
`model: builtin` use; the model is built on first use, as engines do). Engines do not hand out
their tokenizer (OpenEngine's GetModelInfo says whether a model takes text, not how it splits
it), so a text prompt of a model with no tokenizer configured is routed without prefix
knowledge, by load only; token-id prompts never need one.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvplane.errors import ConfigError

BUILTIN = "builtin"


def _load(path: Path) -> Any:
    from tokenizers import Tokenizer

    if str(path) == BUILTIN:
        path = _builtin_tokenizer_file()
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:
        raise ConfigError(f"cannot load tokenizer {path}: {exc}") from exc


class ModelTokenizers:
    def __init__(self, by_model: Mapping[str, Any], default: Any | None = None) -> None:
        self._by_model = dict(by_model)
        self._default = default

    @classmethod
    def load(cls, by_model: Mapping[str, Path], default: Path | None) -> ModelTokenizers:
        """Load every file named (each once, however many models share it)."""
        files = {*by_model.values(), *((default,) if default is not None else ())}
        loaded = {path: _load(path) for path in files}
        return cls(
            {model: loaded[path] for model, path in by_model.items()},
            loaded[default] if default is not None else None,
        )

    def has_own(self, model: str) -> bool:
        """Whether `tokenizers:` names `model` (rather than it taking the default)."""
        return model in self._by_model

    def encode(self, prompt: str, model: str) -> list[int] | None:
        """`prompt` in `model`'s tokens; None when no tokenizer is configured for it."""
        tokenizer = self._by_model.get(model, self._default)
        if tokenizer is None:
            return None
        return list(tokenizer.encode(prompt).ids)


def _builtin_tokenizer_file() -> Path:
    from engine.torch_runner.builtin_model import ensure_builtin_model  # torch-free
    from engine.torch_runner.errors import CheckpointError

    try:
        return ensure_builtin_model() / "tokenizer.json"
    except CheckpointError as exc:
        raise ConfigError(f"cannot load tokenizer builtin: {exc}") from exc
