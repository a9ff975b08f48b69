"""Point-to-point transfers of boundary values: any shapes and dtypes, no shapes to declare.

A boundary value is a tuple of tensors. What one op sends to one rank travels as one *parcel*: a
single transfer, the tensors packed into one byte buffer when there are several (both halves of
an overlapped pair, or a tuple-valued boundary). The program fixes which messages share a parcel,
so sender and receiver agree without asking each other.

The first step with a new input signature (the shapes and dtypes of rank 0's microbatch) is a
*learning* step: every parcel with an activation in it is preceded by a small header giving its
tensors' dtypes and shapes, which both sides cache per message. Later steps with the same
signature send bare data into buffers allocated from the cache. Gradients never need a header: a
gradient has the shape of its activation, which both sides have already seen.

Receives from a rank are posted in the order that rank sends: NCCL matches the transfers between
two ranks in order, and gloo is given matching tags. They are posted ahead of need (``prefetch``):
gloo transmits only once the receiver has posted, so an early receive lets the data land while
this rank computes. Messages to higher and to lower ranks travel on two separate process groups,
so a send never queues behind a receive from the same peer (NCCL runs each group on one stream).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from cutpipe.runtime.failure.heartbeat import Progress
from cutpipe.runtime.program import ACTIVATION, MessageKey, Parcel, RankProgram
from cutpipe.schedule.dataflow import forward_input

if TYPE_CHECKING:
    from cutpipe.runtime.protocols import TransportContext

#: (dtype, shape) of each tensor of a boundary value
Meta = tuple[tuple[torch.dtype, tuple[int, ...]], ...]

HEADER_LENGTH = 64
ALIGN = 16  # bytes: every packed tensor starts aligned for any dtype
DTYPES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)  # fmt: skip
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(DTYPES)}


class PeerLost(RuntimeError):
    """A transfer broke because the peer's process or connection went away."""

    def __init__(self, peer: int | None, reason: str) -> None:
        super().__init__(f"lost rank {peer}: {reason}" if peer is not None else reason)
        self.peer = peer
        self.reason = reason.splitlines()[0] if reason else reason


def wait(work: Any, peer: int | None) -> None:
    """Wait for a transfer; a broken connection becomes ``PeerLost`` naming the peer."""
    try:
        work.wait()
    except RuntimeError as error:
        raise PeerLost(peer, str(error)) from error


class MessageText:
    """ "the activation of stage 1, microbatch 3 from rank 1", formatted only when read (a
    heartbeat reads one a second; the step sets one per receive)."""

    __slots__ = ("key", "src")

    def __init__(self, key: MessageKey, src: int) -> None:
        self.key, self.src = key, src

    def __str__(self) -> str:
        return f"{describe_message(self.key)} from rank {self.src}"


def describe_message(key: MessageKey) -> str:
    direction, stage, microbatch = key
    what = "activation" if direction == ACTIVATION else "input gradient"
    return f"the {what} of stage {stage}, microbatch {microbatch}"


def meta_of(tensors: Sequence[torch.Tensor]) -> Meta:
    return tuple((t.dtype, tuple(t.shape)) for t in tensors)


def encode_header(metas: Sequence[Meta], device: torch.device) -> torch.Tensor:
    """[number of values, then per value: number of tensors, per tensor: dtype, ndim, dims]."""
    values = [len(metas)]
    for meta in metas:
        values.append(len(meta))
        for dtype, shape in meta:
            if dtype not in _DTYPE_CODE:
                raise TypeError(f"cannot send a {dtype} tensor between stages; supported: {DTYPES}")
            values += [_DTYPE_CODE[dtype], len(shape), *shape]
    if len(values) > HEADER_LENGTH:
        raise ValueError(
            f"a parcel of {sum(map(len, metas))} tensors needs {len(values)} header fields; at "
            f"most {HEADER_LENGTH} fit: send fewer or flatter tensors between stages"
        )
    header = torch.zeros(HEADER_LENGTH, dtype=torch.int64)
    header[: len(values)] = torch.tensor(values, dtype=torch.int64)
    return header.to(device)


def decode_header(header: torch.Tensor) -> list[Meta]:
    values = header.tolist()
    metas, position = [], 1
    for _ in range(values[0]):
        count, position = values[position], position + 1
        meta = []
        for _ in range(count):
            dtype, ndim = DTYPES[values[position]], values[position + 1]
            meta.append((dtype, tuple(values[position + 2 : position + 2 + ndim])))
            position += 2 + ndim
        metas.append(tuple(meta))
    return metas


def gradient_meta(meta: Meta) -> Meta:
    """The gradient message of a boundary: one tensor per floating-point activation tensor."""
    return tuple((dtype, shape) for dtype, shape in meta if dtype.is_floating_point)


def _layout(metas: Sequence[Meta]) -> tuple[list[int], int]:
    """Byte offsets of every tensor in a packed parcel, and its total size."""
    offsets, total = [], 0
    for meta in metas:
        for dtype, shape in meta:
            offsets.append(total)
            size = dtype.itemsize * torch.Size(shape).numel()
            total += -(-size // ALIGN) * ALIGN
    return offsets, total


class Mailbox:
    """Sends and receives the boundary values of one rank's program."""

    def __init__(
        self,
        program: RankProgram,
        global_ranks: Sequence[int],
        upward: dist.ProcessGroup,
        downward: dist.ProcessGroup,
        device: torch.device,
        dynamic_shapes: bool = False,
        progress: Progress | None = None,
    ) -> None:
        self._rank = program.rank
        self._progress = progress or Progress()
        self._global = list(global_ranks)
        self._upward, self._downward = upward, downward  # to higher ranks, to lower ranks
        # each pipeline rank's rank in those groups (both have the same members)
        self._in_group = [dist.get_group_rank(upward, rank) for rank in self._global]
        self._device = device
        self._dynamic = dynamic_shapes
        self._learned: dict[MessageKey, Meta] = {}  # activation metas of the current signature
        self._learning: bool | None = True
        self._decide: Callable[[], bool] = lambda: True
        self._program = program
        self._next: dict[int, int] = {}  # per sender: index of its next parcel to post
        self._posted: dict[
            Parcel, tuple[Any, torch.Tensor | None, list[Meta], list[torch.Tensor]]
        ] = {}
        self._arrived: dict[MessageKey, tuple[torch.Tensor, ...]] = {}
        self._sends: deque[tuple[Any, int, torch.Tensor]] = deque()
        self._send_tag: dict[int, int] = {}
        self._recv_tag: dict[int, int] = {}

    @classmethod
    def open(cls, context: TransportContext) -> Mailbox:
        """A mailbox for one runner: two process groups over the pipeline's ranks, one for
        messages to higher ranks and one for messages to lower ranks."""
        ranks = list(context.global_ranks)
        upward = dist.new_group(ranks, use_local_synchronization=True)
        downward = dist.new_group(ranks, use_local_synchronization=True)
        return cls(
            context.program, ranks, upward, downward, context.device,
            context.options.dynamic_shapes, context.progress,
        )  # fmt: skip

    # -- the step ------------------------------------------------------------------------------

    def begin_step(self, program: RankProgram, learning: Callable[[], bool]) -> None:
        """Start a step of ``program`` (training or forward-only: their messages differ).

        ``learning()`` says whether the input signature changed, so that shapes travel with the
        data again; it is asked only when a transfer first needs the answer, which lets the
        signature's broadcast overlap the step's first computation."""
        self._program = program
        self._decide = learning
        self._learning = None
        self._next = dict.fromkeys(program.inbox, 0)
        self._send_tag.clear()
        self._recv_tag.clear()

    @property
    def learning(self) -> bool:
        if self._learning is None:
            self._learning = self._decide() or self._dynamic
            if self._learning:
                self._learned.clear()
        return self._learning

    def end_step(self) -> None:
        """Wait for every send of the step (their tensors stay alive until then)."""
        _ = self.learning  # every rank settles the step's agreement, even one that moved nothing
        progress = self._progress
        while self._sends:
            work, dst, _ = self._sends.popleft()
            progress.wait_for(dst, f"its sends to rank {dst} to complete")
            wait(work, dst)
        progress.done_waiting()
        if self._posted or self._arrived:
            unused = sorted({*self._arrived, *(k for p in self._posted for k in p)})
            raise RuntimeError(f"messages received but never used: {unused}")

    # -- transfers -----------------------------------------------------------------------------

    def _isend(self, tensor: torch.Tensor, dst: int) -> None:
        if self._learning is None:
            _ = self.learning  # nothing moves before the ranks agree on the step
        # the process group's own call: ``dist.isend`` would check and translate ranks again
        # for every message
        group = self._upward if self._rank < dst else self._downward
        tags = self._send_tag
        tag = tags.get(dst, 0)
        tags[dst] = tag + 1
        if tensor.is_complex():
            tensor = torch.view_as_real(tensor)
        try:
            work = group.send([tensor], self._in_group[dst], tag)
        except RuntimeError as error:
            raise PeerLost(dst, str(error)) from error
        sends = self._sends
        sends.append((work, dst, tensor))  # the tensor stays alive until the send is done
        while len(sends) > 1 and sends[0][0].is_completed():
            done, peer, _ = sends.popleft()  # let a sent activation go as soon as it is out
            wait(done, peer)

    def _irecv(self, tensor: torch.Tensor, src: int) -> Any:
        if self._learning is None:
            _ = self.learning
        group = self._upward if src < self._rank else self._downward
        tags = self._recv_tag
        tag = tags.get(src, 0)
        tags[src] = tag + 1
        if tensor.is_complex():
            tensor = torch.view_as_real(tensor)
        try:
            return group.recv([tensor], self._in_group[src], tag)
        except RuntimeError as error:
            raise PeerLost(src, str(error)) from error

    def _meta(self, key: MessageKey) -> Meta | None:
        """The cached shapes of a message (a gradient's follow from its activation's)."""
        if key[0] == ACTIVATION:
            return self._learned.get(key)
        boundary = self._learned.get(forward_input(key[1], key[2]))
        if boundary is None:
            raise RuntimeError(f"gradient {key} arrives before its activation was seen")
        return gradient_meta(boundary)

    def send(self, keys: Parcel, values: Sequence[Sequence[torch.Tensor]], dst: int) -> None:
        """Send one parcel (the values of ``keys``) to rank ``dst``; returns at once."""
        metas = [meta_of(value) for value in values]
        if any(key[0] == ACTIVATION for key in keys):
            if self.learning:
                self._isend(encode_header(metas, self._device), dst)
            for key, meta in zip(keys, metas, strict=True):
                if key[0] != ACTIVATION:
                    continue
                if self._learning:
                    self._learned[key] = meta
                elif self._learned.get(key) != meta:
                    raise ValueError(
                        f"stage {key[1]} produced {meta} for microbatch {key[2]}, but this input "
                        f"shape produced {self._learned.get(key)} before: for outputs whose shapes "
                        "change with the data, build the runner with dynamic_shapes=True"
                    )
        tensors = [t for value in values for t in value]
        if len(tensors) == 1:
            self._isend(tensors[0].contiguous(), dst)
            return
        offsets, total = _layout(metas)
        packed = torch.empty(total, dtype=torch.uint8, device=self._device)
        for offset, tensor in zip(offsets, tensors, strict=True):
            flat = tensor.contiguous().view(-1).view(torch.uint8)
            packed[offset : offset + flat.numel()].copy_(flat)
        self._isend(packed, dst)

    def _post(self, parcel: Parcel, src: int) -> None:
        if self.learning and any(key[0] == ACTIVATION for key in parcel):
            header = torch.empty(HEADER_LENGTH, dtype=torch.int64, device=self._device)
            self._progress.wait_for(
                src, f"the shapes of {describe_message(parcel[0])} from rank {src}"
            )
            wait(self._irecv(header, src), src)
            self._progress.done_waiting()
            metas = decode_header(header)
            for key, meta in zip(parcel, metas, strict=True):
                if key[0] == ACTIVATION:
                    self._learned[key] = meta
        else:
            metas = [self._meta(key) for key in parcel]
        shapes = [(dtype, shape) for meta in metas for dtype, shape in meta]
        if len(shapes) == 1:
            ((dtype, shape),) = shapes
            buffer = torch.empty(shape, dtype=dtype, device=self._device)
            self._posted[parcel] = (self._irecv(buffer, src), None, metas, [buffer])
            return
        offsets, total = _layout(metas)
        packed = torch.empty(total, dtype=torch.uint8, device=self._device)
        views = [
            packed[o : o + dtype.itemsize * torch.Size(shape).numel()].view(dtype).view(shape)
            for o, (dtype, shape) in zip(offsets, shapes, strict=True)
        ]
        self._posted[parcel] = (self._irecv(packed, src), packed, metas, views)

    def _post_through(self, parcel: Parcel, src: int) -> None:
        """Post the receives of ``src``'s parcels up to ``parcel``, in the order ``src`` sends."""
        order, index = self._program.inbox[src], self._next[src]
        while True:
            pending = order[index]
            index += 1
            self._post(pending, src)
            if pending == parcel:
                break
        self._next[src] = index

    def prefetch(self, key: MessageKey, src: int) -> None:
        """Post the receive of a value needed soon, so that it arrives while this rank computes.

        Not in a learning step, where posting waits for the header."""
        parcel = self._program.parcel_of[key]
        if parcel not in self._posted and key not in self._arrived and not self.learning:
            self._post_through(parcel, src)

    def receive(self, key: MessageKey, src: int) -> tuple[torch.Tensor, ...]:
        """Wait for a boundary value from rank ``src``, posting its earlier parcels first."""
        if key in self._arrived:
            return self._arrived.pop(key)
        parcel = self._program.parcel_of[key]
        if parcel not in self._posted:
            self._post_through(parcel, src)
        work, _, metas, views = self._posted.pop(parcel)
        progress = self._progress
        progress.wait_for(src, MessageText(key, src))
        wait(work, src)
        progress.done_waiting()
        position = 0
        for part, meta in zip(parcel, metas, strict=True):
            self._arrived[part] = tuple(views[position : position + len(meta)])
            position += len(meta)
        return self._arrived.pop(key)
