"""NextForward: token n+1's forward, built and queued on token n's lazy output before n's sync.

mlx-lm's generate_step builds and queues the next forward before it reads the current token back, so the host's
graph building overlaps the compute. A device pass (runtime/decode/device_pass.py) does the same: `build()` builds
forward n+1 on forward n's lazy output and queues it at once. Forward n's `finish()` then either promotes it (n was
accepted as it was) or drops it (n needed a repair, which changes its output): its hold is released and the one
position it wrote is rolled back in every cache (trim, or the snapshot of the untrimmable state taken before it was
built), before n is repaired. Measured: on the embedded pair at 100% the engine ran 0.92x of stock with it and 0.79x
without (bench/results/hotpath_decode_embedded.txt, rows "specmoe 100%" and "100% next off").

A dropped forward's graph may still be computing while the repair reads experts into slots it reads: its output is
garbage and never used, and every cache write it made sits at the position the rebuilt forward n+1 writes again
(later graphs take its arrays as inputs, so MLX orders them).

The replay's record of forward n is parked while n+1 is built and made current again after, so n's repair still
skips the layers before its first miss.

Invariants: at most one next forward, between build() and the pending forward's finish(); it holds its layers
from its build to its own sync (or its drop); dropping it leaves every cache as forward n left it, and so does a
build that raised midway (its first layers' caches are rolled back to where they stood).
"""

from __future__ import annotations

from typing import Callable

from runtime.decode.rollback import marks, roll_back, roll_back_to, snapshot_untrimmable


class NextForward:
    def __init__(self, replay, cache, stats):
        self.replay = replay  # the model's LayerReplay
        self.cache = cache  # the ExpertCache (holds)
        self.stats = stats  # the pass's PassStats (next_built, next_dropped)
        self._next = None  # (the built forward, its parked replay state)

    @property
    def exists(self) -> bool:
        return self._next is not None

    def build(self, caches: list, build: Callable[[list], object]) -> None:
        """build(snapshot) -> the next forward, built and queued on the pending forward's output (which wrote
        `caches`). A build that raises leaves the caches as the pending forward left them."""
        snapshot = snapshot_untrimmable(caches)
        undo = marks(caches, snapshot)
        parked = self.replay.park()
        self.replay.start()
        try:
            self._next = (build(snapshot), self.replay.park())
        except BaseException:
            roll_back_to(caches, undo)
            raise
        finally:
            self.replay.resume(parked)
        self.stats.next_built += 1

    def drop(self) -> None:
        """The pending forward needs a repair (or failed): the next one, built on its output, is wrong."""
        if self._next is None:
            return
        built, _ = self._next
        self._next = None
        self.cache.release(built.held)
        roll_back(built.cache, built.snapshot, built.n_tokens)
        self.stats.next_dropped += 1

    def promote(self):
        """The pending forward was accepted: the next one (or None) becomes the pending forward."""
        if self._next is None:
            return None
        built, state = self._next
        self._next = None
        self.replay.resume(state)
        return built
