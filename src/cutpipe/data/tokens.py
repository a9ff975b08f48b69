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
corpus costs no memory until read, and processes on one machine share its pages. Writing streams
the corpus through a temporary file (``cutpipe.files``), so a failed write leaves no half file.
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
        return cls(count, vocab, digest.hex(), name_of_dtype, version)


def read_header(path: str | os.PathLike) -> Header:
    """The header of the token file at ``path``, checked against the file's size."""
    path = Path(path)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise ValueError(f"{path} {what}: give a token file from `cutpipe data prepare`")
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
    (a token file's digest, or one derived from it for a part), which checkpoints carry."""

    values: torch.Tensor
    vocab: int
    fingerprint: str

    def __len__(self) -> int:
        return self.values.numel()

    @classmethod
    def from_tensor(cls, values: torch.Tensor, vocab: int = BYTE_VOCAB) -> Tokens:
        """Tokens held in memory (e.g. in tests); the fingerprint hashes all of them."""
        import torch

        if values.dim() != 1 or values.dtype != torch.uint8:
            raise ValueError(
                f"tokens must be a 1-D uint8 tensor, got {values.dim()}-D {values.dtype}: "
                "use torch.frombuffer(bytearray(text), dtype=torch.uint8)"
            )
        values = values.contiguous().cpu()
        return cls(values, vocab, digest_of(values))

    @classmethod
    def from_bytes(cls, data: bytes | bytearray) -> Tokens:
        """Byte-level tokens of ``data`` (a bytearray is used in place, bytes are copied)."""
        import torch

        if not data:
            raise ValueError("no tokens: give at least one byte")
        buffer = data if isinstance(data, bytearray) else bytearray(data)
        return cls.from_tensor(torch.frombuffer(buffer, dtype=torch.uint8))

    def split(self, holdout: float) -> tuple[Tokens, Tokens]:
        """(training, held-out) tokens: the last ``holdout`` share of the tokens is held out,
        for a validation loss on text the model never trained on."""
        if not 0.0 < holdout < 1.0:
            raise ValueError(f"the held-out share must be between 0 and 1, got {holdout}")
        cut = len(self) - int(len(self) * holdout)
        if cut in (0, len(self)):
            raise ValueError(
                f"holding out {holdout:g} of {len(self):,} tokens leaves one part empty: "
                "use a holdout share nearer 0.5 or more data"
            )
        return self._part(0, cut), self._part(cut, len(self))

    def _part(self, start: int, stop: int) -> Tokens:
        name = f"{self.fingerprint}[{start}:{stop}]".encode()
        return Tokens(self.values[start:stop], self.vocab, hashlib.sha256(name).hexdigest())


def is_token_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a file that starts as a token file does (its header unchecked)."""
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb") as file:
        return file.read(len(MAGIC)) == MAGIC


def read_tokens(path: str | os.PathLike) -> Tokens:
    """The tokens of the token file at ``path``, mapped, not copied; the header is checked
    (``check_digest`` also reads every token to compare them with the digest)."""
    import torch

    header = read_header(path)
    whole = torch.from_file(str(path), shared=False, size=header.file_size, dtype=torch.uint8)
    values = whole[HEADER_SIZE:]
    if whole[:HEADER_SIZE].tolist() != list(header.pack()):
        raise ValueError(f"{path} changed while it was read: read it again")
    return Tokens(values, header.vocab, header.digest)


def check_digest(path: str | os.PathLike, tokens: Tokens) -> None:
    """Raise if ``tokens`` (read from ``path``) do not match their header's digest."""
    if digest_of(tokens.values) != tokens.fingerprint:
        raise ValueError(
            f"{path} is damaged: its tokens do not match the digest in its header; {_PREPARE_AGAIN}"
        )
