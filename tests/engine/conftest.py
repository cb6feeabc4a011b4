"""Fixtures shared by the engine's tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.torch_runner.builtin_model import write_builtin_model


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Tiny models on 2 shared cores: one intra-op thread is ~10x faster than two. A module
    asks for it with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def builtin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The builtin random Llama (`model: builtin`), written once per module."""
    return write_builtin_model(tmp_path_factory.mktemp("builtin"))
