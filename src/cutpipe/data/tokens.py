"""Token files: a corpus's tokens on disk behind a header that says what they are.

A token file is a 64-byte header, then the tokens as one raw array. The header (little-endian):

- bytes 0-7: the magic ``CPTOKENS``; 8-11: the format version (uint32, now 1);
- 12-19: the array's dtype, ASCII padded with NULs (``uint8``);
- 20-27: the number of tokens (uint64); 28-31: the vocabulary size (uint32);
- 32-63: the SHA-256 of the token array.

The header is 64 bytes so the array stays aligned for a wider dtype, should one come. The digest
is of the tokens, not of file names: the same corpus in another folder has the same digest, and it
is the fingerprint a loader's checkpoint carries (``loader.py``), so resuming on other data fails.

Tokens are bytes (vocabulary 256, token = byte), not a BPE vocabulary from the ``tokenizers``
package: bytes need no dependency and no trained vocabulary to ship beside the token file and keep
in step with it, never meet an unknown symbol, and keep the embedding at 256 rows. The price,
sequences three to four times longer for the same text, weighs little when the point is to train
a transformer under pipeline schedules rather than to build the best language model.

Reading maps the file (``torch.from_file``, private mapping) instead of copying it, so a large
corpus costs no memory until read, and processes on one machine share its pages. Before that,
``check_token_file`` reads the tokens once, in blocks and without torch, to compare them with the
header's digest: ``cutpipe data info``, the trainer (``read_tokens``) and the launcher's
pre-check (``cutpipe.data.check_data``) all call it, so a damaged file is refused the same way
everywhere. Writing streams the corpus through a temporary file (``cutpipe.files``), so a failed
write leaves no half file.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cutpipe.data.entries import describe, kind_of
from cutpipe.files import replacing

if TYPE_CHECKING:
    import torch

MAGIC = b"CPTOKENS"
VERSION = 1
#: Byte-level tokens: one per byte value.
BYTE_VOCAB = 256
_LAYOUT = struct.Struct("<8sI8sQI32s")
HEADER_SIZE = _LAYOUT.size
#: dtype name -> (bytes per token, largest vocabulary it holds).
DTYPES = {"uint8": (1, 256)}
_PREPARE_AGAIN = "prepare it again with `cutpipe data prepare`"
#: Bytes hashed at a time when a token file's digest is checked.
_HASH_BLOCK = 2**20


class EmptyCorpus(ValueError):
    """There were no tokens to write."""


@dataclass(frozen=True)
class Header:
    """What a token file says about its tokens; ``digest`` is the hex SHA-256 of the array."""

    count: int
    vocab: int = BYTE_VOCAB
    digest: str = ""
    dtype: str = "uint8"
    version: int = VERSION

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][0]

    @property
    def file_size(self) -> int:
        return HEADER_SIZE + self.count * self.itemsize

    def pack(self) -> bytes:
        return _LAYOUT.pack(
            MAGIC, self.version, self.dtype.encode("ascii"), self.count, self.vocab,
            bytes.fromhex(self.digest),
        )  # fmt: skip

    @classmethod
    def unpack(cls, raw: bytes, name: str) -> Header:
        """The header at the start of ``raw`` (a file's first bytes); ``name`` is for errors."""
        if not raw or not MAGIC.startswith(raw[: len(MAGIC)]):
            raise ValueError(
                f"{name} is not a cutpipe token file (it does not start with {MAGIC.decode()}): "
                "give a file written by `cutpipe data prepare`"
            )
        if len(raw) < HEADER_SIZE:
            raise ValueError(
                f"{name} is truncated: {len(raw)} bytes, shorter than the {HEADER_SIZE}-byte "
                f"header; {_PREPARE_AGAIN}"
            )
        _, version, dtype, count, vocab, digest = _LAYOUT.unpack_from(raw)
        if version != VERSION:
            raise ValueError(
                f"{name} is a version {version} token file; this cutpipe reads version "
                f"{VERSION}: {_PREPARE_AGAIN}"
            )
        name_of_dtype = dtype.rstrip(b"\0").decode("ascii", "replace")
        if name_of_dtype not in DTYPES:
            raise ValueError(
                f"{name} holds tokens of dtype {name_of_dtype!r}, which this cutpipe does not "
                f"read (it reads {', '.join(DTYPES)}): {_PREPARE_AGAIN}"
            )
        if not 1 <= vocab <= DTYPES[name_of_dtype][1]:
            raise ValueError(
                f"{name} says its vocabulary has {vocab} tokens, which {name_of_dtype} cannot "
                f"hold: the file is damaged; {_PREPARE_AGAIN}"
            )
        if count == 0:
            raise ValueError(f"{name} holds no tokens: prepare it again from text that holds some")
        return cls(count, vocab, digest.hex(), name_of_dtype, version)


def read_header(path: str | os.PathLike) -> Header:
    """The header of the token file at ``path``, checked against the file's size."""
    path = Path(path)
    if not _is_regular(path):
        raise ValueError(f"{path} {describe(path)}: give a token file from `cutpipe data prepare`")
    with path.open("rb") as file:
        header = Header.unpack(file.read(HEADER_SIZE), str(path))
    size = path.stat().st_size
    if size < header.file_size:
        held = (size - HEADER_SIZE) // header.itemsize
        raise ValueError(
            f"{path} is truncated: its header says {header.count:,} tokens, it holds {held:,}; "
            f"{_PREPARE_AGAIN}"
        )
    if size > header.file_size:
        raise ValueError(
            f"{path} has {size - header.file_size:,} bytes after its {header.count:,} tokens: "
            f"it is not one whole token file; {_PREPARE_AGAIN}"
        )
    return header


def check_token_file(path: str | os.PathLike) -> Header:
    """The header of the token file at ``path``, once every token has been read (in blocks, no
    torch) and found to match its digest; a one-line ValueError naming the file otherwise."""
    header = read_header(path)
    digest = hashlib.sha256()
    left = header.count * header.itemsize
    with Path(path).open("rb") as file:
        file.seek(HEADER_SIZE)
        while left > 0:
            block = file.read(min(_HASH_BLOCK, left))
            if not block:
                raise ValueError(f"{path} changed while it was read: read it again")
            digest.update(block)
            left -= len(block)
    if digest.hexdigest() != header.digest:
        raise _damaged(path)
    return header


def _damaged(path: str | os.PathLike) -> ValueError:
    return ValueError(
        f"{path} is damaged: its tokens do not match the digest in its header; {_PREPARE_AGAIN}"
    )


def _is_regular(path: Path) -> bool:
    """Whether ``path`` is a regular file (following links), looked at without opening it."""
    try:
        return kind_of(os.stat(path).st_mode) is None
    except OSError:
        return False


def write_tokens(
    path: str | os.PathLike, chunks: Iterable[bytes], vocab: int = BYTE_VOCAB
) -> Header:
    """Write byte tokens (``chunks``, in order) to a token file at ``path``; return its header.

    Streams: the chunks are written as they come, the header last. An empty corpus is refused.
    """
    if not 1 <= vocab <= BYTE_VOCAB:
        raise ValueError(f"byte tokens need a vocabulary of 1 to {BYTE_VOCAB}, got {vocab}")
    digest = hashlib.sha256()
    count = 0
    with replacing(path) as temporary, temporary.open("wb") as file:
        file.write(bytes(HEADER_SIZE))
        for chunk in chunks:
            file.write(chunk)
            digest.update(chunk)
            count += len(chunk)
        if count == 0:
            raise EmptyCorpus(f"no tokens to write to {path}: the corpus is empty")
        header = Header(count, vocab, digest.hexdigest())
        file.seek(0)
        file.write(header.pack())
    return header


def bytes_view(values: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (torch has no buffer protocol);
    valid while ``values`` lives."""
    if values.device.type != "cpu" or not values.is_contiguous():
        raise ValueError("tokens must be a contiguous CPU tensor: call .contiguous().cpu()")
    size = values.numel() * values.element_size()
    if size == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * size).from_address(values.data_ptr())).cast("B")


def digest_of(values: torch.Tensor) -> str:
    """The hex SHA-256 of a token tensor's bytes: what a token file's header holds."""
    return hashlib.sha256(bytes_view(values)).hexdigest()


@dataclass(frozen=True, eq=False)
class Tokens:
    """A 1-D tensor of tokens with its vocabulary and a fingerprint naming exactly these tokens
    (a token file's digest, or one derived from it for a part), which checkpoints carry;
    ``source`` says where they were read, for messages about them."""

    values: torch.Tensor
    vocab: int
    fingerprint: str
    source: str = "the tokens"

    def __len__(self) -> int:
        return self.values.numel()

    @classmethod
    def from_tensor(
        cls, values: torch.Tensor, vocab: int = BYTE_VOCAB, source: str = "the tokens"
    ) -> Tokens:
        """Tokens held in memory (e.g. in tests); the fingerprint hashes all of them."""
        import torch

        if values.dim() != 1 or values.dtype != torch.uint8:
            raise ValueError(
                f"tokens must be a 1-D uint8 tensor, got {values.dim()}-D {values.dtype}: "
                "use torch.frombuffer(bytearray(text), dtype=torch.uint8)"
            )
        values = values.contiguous().cpu()
        return cls(values, vocab, digest_of(values), source)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray, source: str = "the tokens") -> Tokens:
        """Byte-level tokens of ``data`` (a bytearray is used in place, bytes are copied)."""
        import torch

        if not data:
            raise ValueError("no tokens: give at least one byte")
        buffer = data if isinstance(data, bytearray) else bytearray(data)
        return cls.from_tensor(torch.frombuffer(buffer, dtype=torch.uint8), source=source)

    def split(self, holdout: float) -> tuple[Tokens, Tokens]:
        """(training, held-out) tokens: the last ``holdout`` share of the tokens is held out,
        for a validation loss on text the model never trained on."""
        cut = split_point(len(self), holdout)
        return self._part(0, cut, "training"), self._part(cut, len(self), "held-out")

    def _part(self, start: int, stop: int, which: str) -> Tokens:
        name = f"{self.fingerprint}[{start}:{stop}]".encode()
        fingerprint = hashlib.sha256(name).hexdigest()
        return Tokens(self.values[start:stop], self.vocab, fingerprint, f"{self.source} ({which})")


def split_point(count: int, holdout: float) -> int:
    """Where ``Tokens.split`` cuts ``count`` tokens to hold out their last ``holdout`` share
    (the launcher's pre-check counts the parts without reading them)."""
    if not 0.0 < holdout < 1.0:
        raise ValueError(f"the held-out share must be between 0 and 1, got {holdout}")
    cut = count - int(count * holdout)
    if cut in (0, count):
        raise ValueError(
            f"holding out {holdout:g} of {count:,} tokens leaves one part empty: "
            "use a holdout share nearer 0.5 or more data"
        )
    return cut


def is_token_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a file that starts as a token file does (its header unchecked); a
    path that is no regular readable file is not (and is never opened, so a pipe cannot hang)."""
    path = Path(path)
    if not _is_regular(path):
        return False
    try:
        with path.open("rb") as file:
            return file.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def read_tokens(path: str | os.PathLike, verify: bool = True) -> Tokens:
    """The tokens of the token file at ``path``, mapped, not copied; the header is checked, and
    with ``verify`` every token too, against the digest (``check_token_file``)."""
    import torch

    header = check_token_file(path) if verify else read_header(path)
    whole = torch.from_file(str(path), shared=False, size=header.file_size, dtype=torch.uint8)
    values = whole[HEADER_SIZE:]
    if whole[:HEADER_SIZE].tolist() != list(header.pack()):
        raise ValueError(f"{path} changed while it was read: read it again")
    return Tokens(values, header.vocab, header.digest, str(path))


def check_digest(path: str | os.PathLike, tokens: Tokens) -> None:
    """Raise if ``tokens`` (read from ``path``, e.g. with ``verify=False``) do not match their
    header's digest: the check ``check_token_file`` makes on the file, made on the tensor."""
    if digest_of(tokens.values) != tokens.fingerprint:
        raise _damaged(path)
