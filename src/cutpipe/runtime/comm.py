"""Point-to-point transfers of boundary values: any shapes and dtypes, no shapes to declare.

A boundary value is a tuple of tensors. The first step with a new input signature (the shapes and
dtypes of the batch) is a *learning* step: every activation message is preceded by a small header
giving its tensors' dtypes and shapes, which both sides cache per message. Later steps with the
same signature send bare tensors into buffers allocated from the cache. Gradients need no header:
a gradient has the shape of the activation it belongs to, which both sides have already seen.

Receives from a rank are posted in the order that rank sends: NCCL matches the point-to-point
operations between two ranks in order, and gloo is given matching tags. Messages from lower to
higher ranks and from higher to lower ranks travel on two separate process groups, so a send
never waits behind a receive from the same peer (NCCL runs both on one stream per group).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from cutpipe.runtime.program import ACTIVATION, MessageKey, RankProgram

#: (dtype, shape) of each tensor of a boundary value
Meta = tuple[tuple[torch.dtype, tuple[int, ...]], ...]

HEADER_LENGTH = 64
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


def wait(work: object, peer: int | None) -> None:
    """Wait for a transfer; a broken connection becomes ``PeerLost`` naming the peer."""
    try:
        work.wait()  # type: ignore[attr-defined]
    except RuntimeError as error:
        raise PeerLost(peer, str(error)) from error


def meta_of(tensors: Sequence[torch.Tensor]) -> Meta:
    return tuple((t.dtype, tuple(t.shape)) for t in tensors)


def encode_header(meta: Meta, device: torch.device) -> torch.Tensor:
    values = [len(meta)]
    for dtype, shape in meta:
        if dtype not in _DTYPE_CODE:
            raise TypeError(f"cannot send a {dtype} tensor between stages; supported: {DTYPES}")
        values += [_DTYPE_CODE[dtype], len(shape), *shape]
    if len(values) > HEADER_LENGTH:
        raise ValueError(
            f"a stage boundary carries {len(meta)} tensors with {len(values)} header fields; at "
            f"most {HEADER_LENGTH} fit: send fewer or flatter tensors between stages"
        )
    header = torch.zeros(HEADER_LENGTH, dtype=torch.int64)
    header[: len(values)] = torch.tensor(values, dtype=torch.int64)
    return header.to(device)


def decode_header(header: torch.Tensor) -> Meta:
    values = header.tolist()
    meta, position = [], 1
    for _ in range(values[0]):
        dtype, ndim = DTYPES[values[position]], values[position + 1]
        meta.append((dtype, tuple(values[position + 2 : position + 2 + ndim])))
        position += 2 + ndim
    return tuple(meta)


def gradient_meta(meta: Meta) -> Meta:
    """The gradient message of a boundary: one tensor per floating-point activation tensor."""
    return tuple((dtype, shape) for dtype, shape in meta if dtype.is_floating_point)


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
    ) -> None:
        self._rank = program.rank
        self._inbox = program.inbox
        self._global = list(global_ranks)
        self._upward, self._downward = upward, downward  # to higher ranks, to lower ranks
        self._device = device
        self._dynamic = dynamic_shapes
        self._learned: dict[MessageKey, Meta] = {}  # activation metas of the current signature
        self._learning = True
        self._next: dict[int, int] = {}  # per sender: index of its next message to post
        self._posted: dict[MessageKey, tuple[list, list[torch.Tensor]]] = {}
        self._sends: list[tuple[object, int, torch.Tensor]] = []
        self._send_tag: dict[int, int] = {}
        self._recv_tag: dict[int, int] = {}

    def begin_step(self, program: RankProgram, learning: bool) -> None:
        """Start a step of ``program`` (training or forward-only: their messages differ);
        ``learning``: the input signature changed, so shapes travel with the data again."""
        self._inbox = program.inbox
        self._learning = learning or self._dynamic
        if self._learning:
            self._learned.clear()
        self._next = dict.fromkeys(self._inbox, 0)
        self._send_tag.clear()
        self._recv_tag.clear()

    def _tag(self, counters: dict[int, int], peer: int) -> int:
        tag = counters.get(peer, 0)
        counters[peer] = tag + 1
        return tag

    def _isend(self, tensor: torch.Tensor, dst: int) -> None:
        group = self._upward if self._rank < dst else self._downward
        try:
            work = dist.isend(
                tensor, dst=self._global[dst], group=group, tag=self._tag(self._send_tag, dst)
            )
        except RuntimeError as error:
            raise PeerLost(dst, str(error)) from error
        self._sends.append((work, dst, tensor))  # the tensor stays alive until the send is done

    def _irecv(self, tensor: torch.Tensor, src: int) -> object:
        group = self._upward if src < self._rank else self._downward
        try:
            return dist.irecv(
                tensor, src=self._global[src], group=group, tag=self._tag(self._recv_tag, src)
            )
        except RuntimeError as error:
            raise PeerLost(src, str(error)) from error

    def _meta(self, key: MessageKey) -> Meta | None:
        direction, stage, microbatch = key
        if direction == ACTIVATION:
            return self._learned.get(key)
        boundary = self._learned.get((ACTIVATION, stage - 1, microbatch))
        return None if boundary is None else gradient_meta(boundary)

    def send(self, key: MessageKey, tensors: Sequence[torch.Tensor], dst: int) -> None:
        """Send a boundary value to rank ``dst``; returns at once (the send completes later)."""
        if key[0] == ACTIVATION:
            meta = meta_of(tensors)
            if self._learning:
                self._isend(encode_header(meta, self._device), dst)
                self._learned[key] = meta
            elif self._learned.get(key) != meta:
                raise ValueError(
                    f"stage {key[1]} produced {meta} for microbatch {key[2]}, but this input shape "
                    f"produced {self._learned.get(key)} before: for outputs whose shapes change "
                    "with the data, build the runner with dynamic_shapes=True"
                )
        for tensor in tensors:
            self._isend(tensor.contiguous(), dst)

    def _post(self, key: MessageKey, src: int) -> None:
        meta = self._meta(key)
        if meta is None:  # a learning step: the header says what comes
            header = torch.empty(HEADER_LENGTH, dtype=torch.int64, device=self._device)
            wait(self._irecv(header, src), src)
            meta = self._learned[key] = decode_header(header)
        buffers = [torch.empty(shape, dtype=dtype, device=self._device) for dtype, shape in meta]
        self._posted[key] = ([self._irecv(buffer, src) for buffer in buffers], buffers)

    def _post_through(self, key: MessageKey, src: int) -> None:
        """Post the receives of ``src``'s messages up to ``key``, in the order ``src`` sends."""
        order, index = self._inbox[src], self._next[src]
        while True:
            pending = order[index]
            index += 1
            self._post(pending, src)
            if pending == key:
                break
        self._next[src] = index

    def prefetch(self, key: MessageKey, src: int) -> None:
        """Post the receive of a value needed soon, so that it arrives while this rank computes.

        Not in a learning step, where posting waits for the header."""
        if not self._learning and key not in self._posted:
            self._post_through(key, src)

    def receive(self, key: MessageKey, src: int) -> list[torch.Tensor]:
        """Wait for a boundary value from rank ``src``, posting its earlier messages first."""
        if key not in self._posted:
            self._post_through(key, src)
        works, buffers = self._posted.pop(key)
        for work in works:
            wait(work, src)
        return buffers

    def end_step(self) -> None:
        """Wait for every send of the step (their tensors stay alive until then)."""
        for work, dst, _ in self._sends:
            wait(work, dst)
        self._sends.clear()
        if self._posted:
            raise RuntimeError(f"messages received but never used: {sorted(self._posted)}")
