"""What the bridge's target holds of its worker as far as the bridge knows, and which of it to
ask about (pure; one `DeliveredBlocks` per `KvIndexerSink`).

The seed's applies are unconditional and its answers empty, so a target that lost the worker's
blocks (restarted empty, its Redis flushed or evicting keys) never says so; the bridge finds
out by asking for blocks it delivered (MatchExternalKv). This module keeps those blocks and
picks the questions; `indexer.bridge` asks them.

- **Held placements.** Every (tier, key) that an acknowledged batch reported and no later one
  revoked or cleared, keys exactly as sent (engine or canonical): at most the engine's cache.
  Only acknowledged batches count (a batch the target refused changed nothing there), which is
  why this is not the translator's live set: that one is ahead of the target by the batch
  being sent, and by every batch the target refused. The bridge's REPORTs and REVOKEs are the
  seed's plain ones (no copy counts): a REPORT of a held placement changes nothing here.
- **Canary.** One held placement asked about at every probe, so that a whole loss shows at
  once. When it is revoked or cleared, another placement held from before the batch replaces
  it at once (the one asked about least recently): a placement reported after the loss would
  be held by the emptied target and hide it. Only when nothing from before is held does a
  placement of the batch become it (then a loss before the batch lost nothing still held).
- **Rotating sample.** Every probe also asks about the next `size` held placements in turn, so
  that a partial loss (keys evicted, some of them deleted) shows: a held placement is asked
  about at least once every ceil(held / size) probes.
- **Two misses in a row.** A placement found missing is asked about again at the next probe;
  missing again, the loss is confirmed. One miss is not enough: a target's reads may lag the
  applies it acknowledged (kvplane's Redis backend answers while it still replays the batches
  it buffered in an outage).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

from indexer.batch import ActionType, Batch, BlockKey, Tier

Placement = tuple[Tier, BlockKey]


class DeliveredBlocks:
    def __init__(self) -> None:
        # Held placements in the order they are asked about, the next first. A batch appends
        # what it reports, and sampling (between batches) moves what it asked to the end, so
        # during a batch every placement held from before comes before those it added: the
        # first one is the canary's replacement. (OrderedDict: O(1) pops at the front.)
        self._held: OrderedDict[Placement, None] = OrderedDict()
        self.canary: Placement | None = None
        # Placements the last answered probe found missing, for the next one to confirm.
        self._suspects: set[Placement] = set()

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, placement: object) -> bool:
        return placement in self._held

    def applied(self, batch: Batch) -> None:
        """The target acknowledged `batch`: its actions, in order."""
        held = self._held
        for action in batch.actions:
            if action.type is ActionType.REPORT:
                for key in action.hashes:
                    held.setdefault((action.tier, key))
            elif action.type is ActionType.REVOKE:
                for key in action.hashes:
                    held.pop((action.tier, key), None)
            elif action.type is ActionType.CLEAR_ALL_AT_TIER:
                for placement in [p for p in held if p[0] is action.tier]:
                    del held[placement]
            if self.canary not in held:
                self.canary = next(iter(held), None)
        self._suspects &= held.keys()

    def forget(self) -> None:
        """A loss was confirmed: the resync clears the worker on the target, and nothing held
        before counts any more (nor is the same loss reported twice)."""
        self._held.clear()
        self.canary = None
        self._suspects.clear()

    def to_ask(self, size: int) -> list[Placement]:
        """What the next probe asks about: the canary, the suspects, and the next `size` held
        placements in turn (moved to the end of the turn), each once."""
        asked = dict.fromkeys([self.canary] if self.canary is not None else [])
        asked.update(dict.fromkeys(sorted(self._suspects)))
        for _ in range(min(size, len(self._held))):
            placement, _ = self._held.popitem(last=False)
            self._held[placement] = None
            asked[placement] = None
        return list(asked)

    def answered(
        self, asked: Collection[Placement], found: Collection[Placement]
    ) -> list[Placement]:
        """The target answered that of `asked` it holds `found`: the placements it lost (missing
        at this probe and the one before), none while a miss awaits its confirmation."""
        missing = {p for p in asked if p not in found}
        lost = sorted(missing & self._suspects)
        self._suspects = missing - self._suspects
        return lost
