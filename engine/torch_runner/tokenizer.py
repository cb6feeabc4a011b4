"""Load a checkpoint's `tokenizer.json` (Hugging Face `tokenizers`; torch-free).

The returned `tokenizers.Tokenizer` satisfies `engine.core.detokenizer.Tokenizer` (its
`decode(ids, skip_special_tokens=True)`). End-of-sequence ids come from the model config
(`ModelConfig.eos_token_ids`: generation_config.json first, then config.json), not from here.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from engine.torch_runner.errors import CheckpointError


def load_tokenizer(model_dir: Path | str) -> Tokenizer:
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{path} not found: the model directory has no fast tokenizer")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
        raise CheckpointError(f"cannot load {path}: {exc}") from exc
