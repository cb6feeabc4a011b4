"""kvplane's canonical chained block keys."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.keys import block_keys

TOKENS = list(range(1000, 1000 + 10 * 16))


def test_keys_are_stable_signed_64_bit_values() -> None:
    # Pinned: these keys are stored in shared (Redis) indexes and computed by engines; a change
    # of the function is a breaking change of every deployment.
    assert block_keys([1, 2, 3, 4, 5], 2) == [-1302661481779188677, 235667513379440769]
    keys = block_keys(TOKENS, 16)
    assert len(keys) == 10
    assert all(-(1 << 63) <= k < (1 << 63) for k in keys)
    assert len(set(keys)) == 10


def test_only_full_blocks_get_keys() -> None:
    assert block_keys(TOKENS[:15], 16) == []
    assert block_keys(TOKENS[:40], 16) == block_keys(TOKENS, 16)[:2]


def test_a_key_names_its_whole_prefix() -> None:
    keys = block_keys(TOKENS, 16)
    changed = [*TOKENS[:40], 7, *TOKENS[41:]]  # block 2 differs
    other = block_keys(changed, 16)
    assert other[:2] == keys[:2]
    assert all(a != b for a, b in zip(other[2:], keys[2:], strict=True))


def test_continuing_from_a_parent_equals_hashing_the_whole_sequence() -> None:
    keys = block_keys(TOKENS, 16, lora_name="ada", cache_salt="s")
    assert block_keys(TOKENS[48:], 16, parent=keys[2]) == keys[3:]
    # The namespace enters at the root only: a continuation inherits it from its parent.
    assert block_keys(TOKENS[48:], 16, parent=keys[2], lora_name="other") == keys[3:]


@pytest.mark.parametrize("namespace", [{"lora_name": "ada"}, {"cache_salt": "tenant-a"}])
def test_namespaces_never_share_keys(namespace: dict[str, str | None]) -> None:
    plain = block_keys(TOKENS, 16)
    other = block_keys(TOKENS, 16, **namespace)  # type: ignore[arg-type]
    assert not set(plain) & set(other)
    assert block_keys(TOKENS, 16, lora_name="a", cache_salt="b") != block_keys(
        TOKENS, 16, lora_name="ab"
    )
    # A salt (a request's own string) never reaches into another namespace, whatever bytes
    # it holds: each name is length-prefixed.
    assert block_keys(TOKENS, 16, lora_name="a\x01b") != block_keys(
        TOKENS, 16, lora_name="a", cache_salt="b\x00"
    )


def test_an_empty_lora_name_or_salt_is_none() -> None:
    # The wire's "" means unset: events and MatchTokens must meet in one key space.
    plain = block_keys(TOKENS, 16)
    assert block_keys(TOKENS, 16, lora_name="", cache_salt="") == plain
    assert block_keys(TOKENS, 16, lora_name="ada", cache_salt="") == block_keys(
        TOKENS, 16, lora_name="ada"
    )


def test_multimodal_ids_change_their_block_and_the_rest() -> None:
    keys = block_keys(TOKENS, 16)
    mm = block_keys(TOKENS, 16, mm_hashes=[None, None, ["img-1"]])
    assert mm[:2] == keys[:2]
    assert all(a != b for a, b in zip(mm[2:], keys[2:], strict=True))
    assert block_keys(TOKENS, 16, mm_hashes=[None, None, ["img-2"]])[2] != mm[2]
    assert block_keys(TOKENS, 16, mm_hashes=[]) == keys


def test_invalid_input() -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_keys(TOKENS, 0)
    for bad in ([-1, 2], [1 << 32, 2]):
        with pytest.raises(ValueError, match="token ids"):
            block_keys(bad, 2)


@settings(max_examples=100, deadline=None)
@given(
    tokens=st.lists(st.integers(0, (1 << 32) - 1), max_size=64),
    block_size=st.integers(1, 8),
    split=st.integers(1, 8),
)
def test_chaining_property(tokens: list[int], block_size: int, split: int) -> None:
    keys = block_keys(tokens, block_size)
    assert len(keys) == len(tokens) // block_size
    if len(keys) > split:
        rest = block_keys(tokens[split * block_size :], block_size, parent=keys[split - 1])
        assert rest == keys[split:]
