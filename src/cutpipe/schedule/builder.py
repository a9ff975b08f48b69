"""``RankBuilder``: write one rank's ops as "forward of this stage, backward of that stage".

Most published schedules are described per rank as a sequence of F / B / W steps on the rank's
stages, with microbatches taken in order. The builder numbers the microbatches, queues the W of
every split backward (first in, first out, per stage or across the rank), pairs overlapped F&B
steps, and skips steps whose microbatch is beyond the stage's count. That last rule lets a
schedule written for a minimum microbatch count run fewer, the way PyTorch's ZB-V does.

Backwards take the microbatches in the order the forwards did, unless ``reverse_backwards`` is
set: then the newest microbatch goes back first, as in breadth-first (looped) schedules, which
run a stage's whole backward wave right after its forward wave.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from operator import length_hint

from cutpipe.schedule.codes import B_CODE, BW_CODE, F_CODE, KIND_BITS, W_CODE, Codec


class RankBuilder:
    """Emits the op codes of one rank."""

    def __init__(
        self,
        codec: Codec,
        microbatches: Mapping[int, Iterable[int]],
        steps: int = 0,
        reverse_backwards: bool = False,
    ) -> None:
        """``microbatches`` maps each stage this rank runs to the microbatch ids it runs, in order.

        ``steps``: how many steps per stage the schedule is written for, if more than it has
        microbatches; the steps past the last microbatch are skipped. ``reverse_backwards``: the
        backwards of a stage take its microbatches last first (skipped steps, being the
        newest, come first).
        """
        self._codec = codec
        streams = {}
        for stage, ids in microbatches.items():
            codes: list[int | None] = [codec.action(F_CODE, stage, mb) for mb in ids]
            streams[stage] = codes + [None] * (steps - len(codes))
        # each step takes the next code (None: a skipped microbatch); running out is a bug
        self._forwards = {stage: iter(codes) for stage, codes in streams.items()}
        self._backwards = {
            stage: iter(codes[::-1] if reverse_backwards else codes)
            for stage, codes in streams.items()
        }
        self._pending_w: deque[int] = deque()  # W codes in the order their B ran
        self._pending_w_of: dict[int, deque[int]] = {stage: deque() for stage in streams}
        self.codes: list[int] = []

    def forwards_left(self, stage: int) -> int:
        """How many forward steps of ``stage`` remain, skipped microbatches included."""
        return length_hint(self._forwards[stage])

    def _backward(self, stage: int, split: bool) -> int | None:
        code = next(self._backwards[stage])
        if code is None or not split:
            return code if code is None else code | BW_CODE
        self._pending_w.append(code | W_CODE)
        self._pending_w_of[stage].append(code | W_CODE)
        return code | B_CODE

    def forward(self, stage: int) -> None:
        """F of the next microbatch of ``stage``."""
        code = next(self._forwards[stage])
        if code is not None:
            self.codes.append(code)

    def backward(self, stage: int, split: bool = False) -> None:
        """Backward of the next microbatch of ``stage``: BW, or B with its W queued if ``split``."""
        code = self._backward(stage, split)
        if code is not None:
            self.codes.append(code)

    def weight(self, stage: int | None = None) -> None:
        """W of the oldest pending split backward (of ``stage`` if given); nothing if none pends."""
        queue = self._pending_w if stage is None else self._pending_w_of[stage]
        if not queue:
            return
        code = queue.popleft()
        # the same W waits in the other queue too: drop it there (at or near the front)
        if stage is None:
            self._pending_w_of[(code >> KIND_BITS) % self._codec.num_stages].remove(code)
        else:
            self._pending_w.remove(code)
        self.codes.append(code)

    def weights(self, stage: int | None = None) -> None:
        """Every pending W (of ``stage`` if given), oldest first."""
        queue = self._pending_w if stage is None else self._pending_w_of[stage]
        while queue:
            self.weight(stage)

    def overlap(self, forward_stage: int, backward_stage: int, split: bool = False) -> None:
        """F of ``forward_stage`` and backward of ``backward_stage`` as one overlapped pair.

        If one half's microbatch is skipped, the other half runs alone.
        """
        forward = next(self._forwards[forward_stage])
        backward = self._backward(backward_stage, split)
        if forward is not None and backward is not None:
            self.codes.append(self._codec.pair(forward, backward))
        else:
            self.codes.extend(code for code in (forward, backward) if code is not None)
