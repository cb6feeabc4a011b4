"""Conversions between kv_indexer.v1 / kvplane.v1 messages and the index's dataclasses.

Adapter code: the servicers, the bridge and the index benchmark use it; the core never sees protos.
`batch_from_proto` keeps unknown enum values as they are so that `indexer.index.validate_batch`
rejects them with the seed's status code and in the seed's order (worker id, action count,
hash total, each action).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

from indexer.backend import (
    IndexStats,
    PrefixResult,
    TokenPrefixMatch,
    WorkerPlacements,
)
from indexer.batch import Action, ActionType, Batch, CacheSpec, Tier
from kv_indexer.v1 import kv_indexer_pb2 as kv
from kvplane_api.v1 import index_pb2 as api

# Wire enum value -> enum member; unknown values pass through unconverted (as ints) so that
# validate_batch rejects them. Dict lookups: an Enum call costs several times more.
_action_type = cast(Callable[[int, int], ActionType], {int(a): a for a in ActionType}.get)
_tier = cast(Callable[[int, int], Tier], {int(t): t for t in Tier}.get)
# Action and Batch are named tuples: `tuple.__new__` builds one from all of its fields in order
# without the Python-level `__new__` (a third of the cost). The field lists are checked here.
_new = tuple.__new__
if Action._fields != (
    "type",
    "tier",
    "hashes",
    "component_masks",
    "block_sizes",
    "parent",
    "copies",
) or Batch._fields != (
    "worker_id",
    "actions",
    "worker_address",
    "seq",
    "cache_spec",
    "under_lease",
):
    raise ImportError("indexer.kv_wire.batch_from_proto does not know Action's or Batch's fields")


def spec_from_proto(spec: kv.WorkerCacheSpec) -> CacheSpec:
    return CacheSpec(
        version=spec.version,
        components=spec.components,
        swa_window_tokens=spec.swa_window_tokens,
        full_tier_mask=spec.full_tier_mask,
        swa_tier_mask=spec.swa_tier_mask,
        mamba_tier_mask=spec.mamba_tier_mask,
    )


def spec_to_proto(spec: CacheSpec) -> kv.WorkerCacheSpec:
    return kv.WorkerCacheSpec(
        version=spec.version,
        components=spec.components,
        swa_window_tokens=spec.swa_window_tokens,
        full_tier_mask=spec.full_tier_mask,
        swa_tier_mask=spec.swa_tier_mask,
        mamba_tier_mask=spec.mamba_tier_mask,
    )


def batch_from_proto(request: kv.ApplyExternalKvBatchRequest) -> Batch:
    """The request as a `Batch`, in one pass over the wire message (not validated: the
    backend's `apply` validates, before it changes anything).

    Hot path (ApplyExternalKvBatch): each repeated field is read once and copied by slicing
    (a C-level copy; iterating a repeated field costs twice as much), empty ones not at all;
    the enum lookups are dict lookups; the named tuples are built without keyword handling."""
    action_type = _action_type
    tier_of = _tier
    actions: list[Action] = []
    append = actions.append
    for a in request.actions[:]:
        kind = a.type
        tier = a.tier
        masks = a.component_masks
        sizes = a.block_sizes
        action = (
            action_type(kind, kind),
            tier_of(tier, tier),
            tuple(a.hashes[:]),
            tuple(masks[:]) if masks else (),
            tuple(sizes[:]) if sizes else (),
            a.parent_block_hash if a.HasField("parent_block_hash") else None,
            False,
        )
        append(_new(Action, action))
    batch = (
        request.worker_id,
        tuple(actions),
        request.worker_address,
        request.seq,
        spec_from_proto(request.cache_spec) if request.HasField("cache_spec") else None,
        False,  # the KVIndexer API's applies are unconditional (seed 004)
    )
    return _new(Batch, batch)


def batch_to_proto(batch: Batch) -> kv.ApplyExternalKvBatchRequest:
    """The wire form of a batch (Action.copies has no wire form: the sender counts copies)."""
    request = kv.ApplyExternalKvBatchRequest(
        worker_id=batch.worker_id, seq=batch.seq, worker_address=batch.worker_address
    )
    for action in batch.actions:
        wire = request.actions.add(
            type=int(action.type),
            tier=int(action.tier),
            hashes=action.hashes,
            component_masks=action.component_masks,
            block_sizes=action.block_sizes,
        )
        if action.parent is not None:
            wire.parent_block_hash = action.parent
    if batch.cache_spec is not None:
        request.cache_spec.CopyFrom(spec_to_proto(batch.cache_spec))
    return request


def match_to_proto(placements: list[WorkerPlacements]) -> kv.MatchExternalKvResponse:
    response = kv.MatchExternalKvResponse()
    for worker in placements:
        node = response.matches.add(worker_id=worker.worker_id, address=worker.address)
        for tier in worker.by_tier:
            node.hashes_by_tier.add(
                tier=int(tier.tier),
                hashes=tier.hashes,
                component_masks=tier.component_masks,
                block_sizes=tier.block_sizes,
            )
    return response


def prefix_to_proto(result: PrefixResult) -> kv.MatchExternalKvPrefixResponse:
    response = kv.MatchExternalKvPrefixResponse(
        best_prefix_blocks=result.best_prefix_blocks, blocks_read=result.blocks_read
    )
    for match in result.matches:
        response.matches.add(
            worker_address=match.worker_address,
            matched_prefix_blocks=match.matched_prefix_blocks,
            worker_id=match.worker_id,
        )
    return response


def token_matches_to_proto(
    matches: list[TokenPrefixMatch], block_keys: list[int]
) -> api.MatchTokensResponse:
    response = api.MatchTokensResponse(num_query_blocks=len(block_keys), block_keys=block_keys)
    for match in matches:
        worker = response.matches.add(
            worker_id=match.worker_id,
            worker_address=match.worker_address,
            matched_blocks=match.matched_blocks,
            matched_tokens=match.matched_tokens,
            any_tier_blocks=match.any_tier_blocks,
            any_tier_tokens=match.any_tier_tokens,
        )
        for tier in match.tiers:
            worker.tiers.add(
                tier=int(tier.tier),
                matched_blocks=tier.matched_blocks,
                matched_tokens=tier.matched_tokens,
            )
    return response


def stats_to_proto(
    stats: IndexStats,
    *,
    num_batches_applied: int = 0,
    num_events_dropped: int = 0,
    keyings: Sequence[api.WorkerKeying] = (),
) -> api.IndexStats:
    response = api.IndexStats(
        backend=stats.backend,
        num_blocks=stats.num_blocks,
        num_placements=stats.num_placements,
        num_workers=len(stats.workers),
        num_batches_applied=num_batches_applied,
        num_events_dropped=num_events_dropped,
        keyings=keyings,
    )
    for worker in stats.workers:
        response.workers.add(
            worker_id=worker.worker_id,
            worker_address=worker.worker_address,
            num_blocks=worker.num_blocks,
            num_placements=worker.num_placements,
        )
    return response
