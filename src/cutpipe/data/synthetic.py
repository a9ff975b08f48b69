"""Synthetic regression data: random inputs and a teacher's answers to them.

Batch ``i``'s inputs are drawn from a generator seeded by ``(seed, i)`` alone and its targets
are ``teacher(inputs)``, so the batches need no files, depend on nothing but ``seed`` and the
teacher, and a resumed run sees exactly the batches the uninterrupted run would have. The
example MLP's teacher is an MLP of its own shape with other weights (``cutpipe.train.tasks``):
a target the student can reach, so its loss falls towards zero.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cutpipe.data.loader import epoch_seed

if TYPE_CHECKING:
    import torch

STATE_VERSION = 1


class RegressionLoader:
    """An endless iterator of ``(inputs, targets)`` float tensors of shape [batch_size, width]."""

    def __init__(
        self,
        width: int,
        batch_size: int,
        seed: int,
        teacher: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        for name, value in (("width", width), ("batch_size", batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
        self.width, self.batch_size, self.seed = width, batch_size, int(seed)
        self.teacher = teacher
        self.index = 0  # the next batch

    def __iter__(self) -> RegressionLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        generator = torch.Generator().manual_seed(epoch_seed(self.seed, self.index))
        inputs = torch.randn(self.batch_size, self.width, generator=generator)
        self.index += 1
        with torch.no_grad():
            return inputs, self.teacher(inputs)

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION, "index": self.index, "seed": self.seed,
            "width": self.width, "batch_size": self.batch_size,
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (``state_dict`` of a loader of the same shape and seed)."""
        missing = sorted(set(self.state_dict()) - set(state))
        if missing:
            raise ValueError(f"the loader state lacks {', '.join(missing)}: give a state_dict()")
        for key in ("version", "seed", "width", "batch_size"):
            if state[key] != getattr(self, key, STATE_VERSION):
                raise ValueError(
                    f"the loader state was saved with {key} {state[key]}, this loader has "
                    f"{getattr(self, key, STATE_VERSION)}: resume with the same {key}"
                )
        index = state["index"]
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"the loader state's position {index!r} is damaged")
        self.index = index
