"""`TokenFile`: a bearer token followed on disk as it is rotated, and what a rotation caught
halfway (an empty or missing file) leaves in use."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvplane.errors import ConfigError
from kvplane.token_file import TokenFile


def test_a_token_rotated_on_disk_is_used_from_the_next_read(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("  first\n")
    token = TokenFile(path, "engine_token_file")
    assert token.current() == "first"
    partial = tmp_path / ".token.new"
    partial.write_text("second\n")
    partial.replace(path)  # as a Kubernetes Secret's update or `mv` swaps it
    assert token.current() == "second"
    path.write_text("third-and-longer\n")  # rewritten in place
    assert token.current() == "third-and-longer"


def test_an_empty_or_missing_file_keeps_the_last_token_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A file caught halfway through a non-atomic write (empty), or removed before its
    replacement is written, is not a token: calls keep the one read before."""
    path = tmp_path / "token"
    path.write_text("kept\n")
    token = TokenFile(path, "auth.token_file")
    with caplog.at_level(logging.WARNING, logger="kvplane.token_file"):
        path.write_text("")
        assert token.current() == "kept"
        assert token.current() == "kept"  # the same change: no second warning
        path.unlink()
        assert token.current() == "kept"
    assert [r.getMessage() for r in caplog.records] == [
        f"auth.token_file {path} is empty; keeping the token read before",
        f"cannot read auth.token_file {path}: No such file or directory; keeping the token "
        "read before",
    ]
    path.write_text("back\n")
    assert token.current() == "back"


def test_a_file_unusable_at_start_is_a_config_error_naming_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^cannot read engine_token_file .*/missing: No such"):
        TokenFile(tmp_path / "missing", "engine_token_file")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match=r"^engine_token_file .*/empty is empty$"):
        TokenFile(tmp_path / "empty", "engine_token_file")


def test_a_kubernetes_secrets_symlink_swap_is_followed(tmp_path: Path) -> None:
    """A Secret mounted as a volume: `token` links to `..data/token`, and an update points
    `..data` at a new folder (the link `token` itself never changes)."""
    first, second = tmp_path / "..2026_01", tmp_path / "..2026_02"
    for folder, value in ((first, "first"), (second, "second")):
        folder.mkdir()
        (folder / "token").write_text(f"{value}\n")
    data = tmp_path / "..data"
    data.symlink_to(first.name)
    path = tmp_path / "token"
    path.symlink_to("..data/token")
    token = TokenFile(path, "auth.token_file")
    assert token.current() == "first"
    swap = tmp_path / "..data_tmp"
    swap.symlink_to(second.name)
    swap.replace(data)
    assert token.current() == "second"
