"""Batches of token windows in an order fixed by a seed, resumable from a checkpoint.

The tokens are cut into windows of ``seq_len + 1`` tokens starting every ``seq_len`` tokens (so
neighbours share one token and every token after the first is a target once per epoch). A window
gives ``inputs`` (its first ``seq_len`` tokens) and ``targets`` (its last ``seq_len``: the inputs
shifted by one). Each epoch visits the windows in a permutation drawn by a ``torch.Generator``
seeded from ``(seed, epoch)`` alone, so the order depends on nothing but those two numbers.

A global batch is ``batch_size x replicas`` consecutive windows of the permutation; replica
``rank`` takes rows ``rank * batch_size`` to ``(rank + 1) * batch_size`` of it, so data-parallel
replicas see disjoint windows that together make the global batch. An epoch has
``windows // (batch_size x replicas)`` batches; the windows left over wait for later epochs' orders.

The position (epoch, batch index) is the loader's whole state: ``state_dict`` gives it with the
seed, the shape and the tokens' fingerprint, and ``load_state_dict`` refuses a state from other
tokens or another shape, so a resumed run sees exactly the batches the uninterrupted run would
have. A validation set is read in order instead, the same windows every time
(``cutpipe.data.heldout``).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from cutpipe.data.tokens import Tokens

if TYPE_CHECKING:
    import torch

#: Bumped when the meaning of a state changes, so an old checkpoint is refused, not misread.
STATE_VERSION = 1


def windows_of(count: int, seq_len: int) -> int:
    """How many windows of ``seq_len + 1`` tokens, starting every ``seq_len``, ``count`` make."""
    return max(0, (count - 1) // seq_len)


def check_windows(count: int, seq_len: int, source: str, windows: int = 1) -> None:
    """A one-line ValueError naming ``source`` if its ``count`` tokens make fewer than
    ``windows`` windows (one global batch: batch size x replicas)."""
    made = windows_of(count, seq_len)
    if made >= windows:
        return
    need = "one window" if windows == 1 else f"one global batch ({windows:,} windows)"
    tokens, made_windows = _counted(count, "token"), _counted(made, "window")
    raise ValueError(
        f"{source} holds {tokens}, {made_windows} of {seq_len + 1} tokens, fewer than {need}: "
        "use a shorter sequence, a smaller batch or more data"
    )


def _counted(count: int, noun: str) -> str:
    return f"{count:,} {noun}{'s' if count != 1 else ''}"


def epoch_seed(seed: int, epoch: int) -> int:
    """The generator seed of one epoch: a hash of (seed, epoch), so nearby seeds or epochs do
    not give related permutations and no two pairs share one by arithmetic accident."""
    text = f"cutpipe.data:{seed}:{epoch}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 1


class TokenLoader:
    """An endless iterator of ``(inputs, targets)`` LongTensors of shape [batch_size, seq_len]
    for replica ``rank`` of ``replicas`` (module docstring: order, replicas, resuming)."""

    def __init__(
        self,
        tokens: Tokens | torch.Tensor,
        seq_len: int,
        batch_size: int,
        seed: int,
        rank: int = 0,
        replicas: int = 1,
    ) -> None:
        import torch

        self.tokens = tokens if isinstance(tokens, Tokens) else Tokens.from_tensor(tokens)
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size),
                            ("replicas", replicas)):  # fmt: skip
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
        if not isinstance(rank, int) or not 0 <= rank < replicas:
            raise ValueError(
                f"rank must be in 0..{replicas - 1} for {replicas} replicas, got {rank!r}"
            )
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, int(seed)
        self.rank, self.replicas = rank, replicas
        self.windows = windows_of(len(self.tokens), seq_len)
        check_windows(len(self.tokens), seq_len, self.tokens.source, batch_size * replicas)
        self.batches_per_epoch = self.windows // (batch_size * replicas)
        self.epoch = 0
        self.index = 0  # the next batch within the epoch
        self._order: tuple[int, torch.Tensor] | None = None
        self._offsets = torch.arange(seq_len + 1)

    def __iter__(self) -> TokenLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        order = self._permutation(self.epoch)
        first = (self.index * self.replicas + self.rank) * self.batch_size
        starts = order[first : first + self.batch_size] * self.seq_len
        rows = self.tokens.values[starts[:, None] + self._offsets].long()
        self.index += 1
        if self.index == self.batches_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def _permutation(self, epoch: int) -> torch.Tensor:
        """The windows' order in ``epoch``, kept while the epoch lasts."""
        import torch

        if self._order is None or self._order[0] != epoch:
            generator = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
            self._order = (epoch, torch.randperm(self.windows, generator=generator))
        return self._order[1]

    def state_dict(self) -> dict[str, Any]:
        """Where the loader is, and what it reads: the same for every rank."""
        return {
            "version": STATE_VERSION, "epoch": self.epoch, "index": self.index,
            "seed": self.seed, "fingerprint": self.tokens.fingerprint, "seq_len": self.seq_len,
            "batch_size": self.batch_size, "replicas": self.replicas,
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (``state_dict`` of a loader on the same tokens and shape)."""
        missing = sorted(set(self.state_dict()) - set(state))
        if missing:
            raise ValueError(f"the loader state lacks {', '.join(missing)}: give a state_dict()")
        if state["version"] != STATE_VERSION:
            raise ValueError(
                f"the loader state is of version {state['version']}, this cutpipe reads "
                f"{STATE_VERSION}: restart the run"
            )
        if state["fingerprint"] != self.tokens.fingerprint:
            raise ValueError(
                f"the loader state was saved reading tokens {state['fingerprint'][:16]}, these "
                f"are {self.tokens.fingerprint[:16]}: resume with the same token file and holdout"
            )
        for key in ("seed", "seq_len", "batch_size", "replicas"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"the loader state was saved with {key} {state[key]}, this loader has "
                    f"{getattr(self, key)}: resume with the same {key}"
                )
        epoch, index = state["epoch"], state["index"]
        if not (isinstance(epoch, int) and epoch >= 0) or not (
            isinstance(index, int) and 0 <= index < self.batches_per_epoch
        ):
            raise ValueError(
                f"the loader state's position (epoch {epoch!r}, batch {index!r}) is outside "
                f"this data's {self.batches_per_epoch} batches per epoch: it is damaged"
            )
        self.epoch, self.index = epoch, index
