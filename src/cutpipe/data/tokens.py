"""Token files: a corpus's tokens on disk behind a header that says what they are.

A token file is a header, then the tokens as one raw little-endian array. The header
(little-endian):

- bytes 0-7: the magic ``CPTOKENS``; 8-11: the format version (uint32, 1 or 2);
- 12-19: the array's dtype, ASCII padded with NULs (``uint8``, ``uint16``, ``uint32``);
- 20-27: the number of tokens (uint64); 28-31: the vocabulary size (uint32);
- 32-63: the SHA-256 of the token array;
- version 2 only: 64-95: the SHA-256 of the tokenizer (``tokenizer.TextTokenizer.digest``);
  96-99: the id of its end-of-sequence token (uint32); 100-127: zeros.

Version 1 (64 bytes) holds byte tokens (uint8, vocabulary 256, token = byte): its tokenizer is
``"bytes"`` and its documents are separated by a NUL byte, not an EOS token. ``cutpipe data
prepare`` still writes it without ``--tokenizer``, so a byte corpus keeps the file and digest it
had. Version 2 (128 bytes) holds a Hugging Face tokenizer's ids in the narrowest dtype that holds
its vocabulary, and names the tokenizer, so training with another one is refused. Both headers
keep the array aligned for its dtype. The digest is of the tokens, not of file names: the same
corpus in another folder has the same digest, and it is the fingerprint a loader's checkpoint
carries (``loader.py``), so resuming on other data fails.

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
#: The newest version, written for a tokenizer's ids; byte tokens are still written as version 1.
VERSION = 2
#: Byte-level tokens: one per byte value.
BYTE_VOCAB = 256
#: What the tokenizer of byte tokens (every version 1 file) is called where a digest would be.
BYTES = "bytes"
_LAYOUT = struct.Struct("<8sI8sQI32s")
_EXTRA = struct.Struct("<32sI28x")  # version 2: the tokenizer's digest, the EOS id
#: The size of a version 1 header (version 2's: ``HEADER_SIZES``).
HEADER_SIZE = _LAYOUT.size
HEADER_SIZES = {1: HEADER_SIZE, 2: HEADER_SIZE + _EXTRA.size}
#: dtype name -> (bytes per token, largest vocabulary it holds).
DTYPES = {"uint8": (1, 2**8), "uint16": (2, 2**16), "uint32": (4, 2**32)}
_PREPARE_AGAIN = "prepare it again with `cutpipe data prepare`"
#: Bytes hashed at a time when a token file's digest is checked.
_HASH_BLOCK = 2**20


class EmptyCorpus(ValueError):
    """There were no tokens to write."""


@dataclass(frozen=True)
class Header:
    """What a token file says about its tokens; ``digest`` is the hex SHA-256 of the array,
    ``tokenizer`` the hex SHA-256 of the tokenizer (``BYTES`` for byte tokens, version 1) and
    ``eos`` its end-of-sequence id (None for bytes)."""

    count: int
    vocab: int = BYTE_VOCAB
    digest: str = ""
    dtype: str = "uint8"
    version: int = 1
    tokenizer: str = BYTES
    eos: int | None = None

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][0]

    @property
    def size(self) -> int:
        """The header's own size: where the tokens start."""
        return HEADER_SIZES[self.version]

    @property
    def file_size(self) -> int:
        return self.size + self.count * self.itemsize

    def pack(self) -> bytes:
        raw = _LAYOUT.pack(
            MAGIC, self.version, self.dtype.encode("ascii"), self.count, self.vocab,
            bytes.fromhex(self.digest),
        )  # fmt: skip
        if self.version == 1:
            return raw
        return raw + _EXTRA.pack(bytes.fromhex(self.tokenizer), self.eos)

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
        if version not in HEADER_SIZES:
            raise ValueError(
                f"{name} is a version {version} token file; this cutpipe reads versions "
                f"{' and '.join(map(str, HEADER_SIZES))}: {_PREPARE_AGAIN}"
            )
        if len(raw) < HEADER_SIZES[version]:
            raise ValueError(
                f"{name} is truncated: {len(raw)} bytes, shorter than the "
                f"{HEADER_SIZES[version]}-byte header of version {version}; {_PREPARE_AGAIN}"
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
        if version == 1:
            if name_of_dtype != "uint8":
                raise ValueError(
                    f"{name} is a version 1 token file of {name_of_dtype}: version 1 holds bytes "
                    f"(uint8) only; the file is damaged; {_PREPARE_AGAIN}"
                )
            return cls(count, vocab, digest.hex(), name_of_dtype, version)
        tokenizer, eos = _EXTRA.unpack_from(raw, HEADER_SIZE)
        if eos >= vocab:
            raise ValueError(
                f"{name} says its end-of-sequence token is {eos}, outside its vocabulary of "
                f"{vocab}: the file is damaged; {_PREPARE_AGAIN}"
            )
        return cls(count, vocab, digest.hex(), name_of_dtype, version, tokenizer.hex(), eos)


def read_header(path: str | os.PathLike) -> Header:
    """The header of the token file at ``path``, checked against the file's size."""
    path = Path(path)
    if not _is_regular(path):
        raise ValueError(f"{path} {describe(path)}: give a token file from `cutpipe data prepare`")
    with path.open("rb") as file:
        header = Header.unpack(file.read(max(HEADER_SIZES.values())), str(path))
    size = path.stat().st_size
    if size < header.file_size:
        held = (size - header.size) // header.itemsize
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
        file.seek(header.size)
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


def dtype_for(vocab: int) -> str:
    """The narrowest dtype whose values hold every token of a ``vocab``-token vocabulary."""
    for name, (_, most) in DTYPES.items():
        if 1 <= vocab <= most:
            return name
    raise ValueError(f"a vocabulary of {vocab:,} tokens does not fit in uint32: give 1 to 2**32")


def write_tokens(
    path: str | os.PathLike,
    chunks: Iterable[bytes],
    vocab: int = BYTE_VOCAB,
    tokenizer: str = BYTES,
    eos: int | None = None,
) -> Header:
    """Write tokens (``chunks``, in order) to a token file at ``path``; return its header.

    With ``tokenizer`` ``BYTES`` the chunks are byte tokens and the file is of version 1; with a
    tokenizer's hex digest they are its ids, packed little-endian in ``dtype_for(vocab)``
    (``tokenizer.pack``), with ``eos`` its end-of-sequence id, and the file is of version 2.
    Streams: the chunks are written as they come, the header last. An empty corpus is refused.
    """
    if tokenizer == BYTES:
        if not 1 <= vocab <= BYTE_VOCAB:
            raise ValueError(f"byte tokens need a vocabulary of 1 to {BYTE_VOCAB}, got {vocab}")
        if eos is not None:
            raise ValueError("byte tokens have no end-of-sequence id: give eos=None")
        version, dtype = 1, "uint8"
    else:
        if len(tokenizer) != 64 or not all(c in "0123456789abcdef" for c in tokenizer):
            raise ValueError(f"a tokenizer is named by its hex SHA-256, got {tokenizer!r}")
        if eos is None or not 0 <= eos < vocab:
            raise ValueError(f"the end-of-sequence id must be in 0..{vocab - 1}, got {eos!r}")
        version, dtype = 2, dtype_for(vocab)
    itemsize = DTYPES[dtype][0]
    digest = hashlib.sha256()
    size = 0
    with replacing(path) as temporary, temporary.open("wb") as file:
        file.write(bytes(HEADER_SIZES[version]))
        for chunk in chunks:
            file.write(chunk)
            digest.update(chunk)
            size += len(chunk)
        if size == 0:
            raise EmptyCorpus(f"no tokens to write to {path}: the corpus is empty")
        if size % itemsize:
            raise ValueError(f"the chunks hold {size} bytes, not whole {dtype} tokens")
        header = Header(size // itemsize, vocab, digest.hexdigest(), dtype, version, tokenizer, eos)
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
    ``source`` says where they were read, for messages about them; ``tokenizer`` and ``eos``
    what made them (``BYTES`` and None for byte tokens)."""

    values: torch.Tensor
    vocab: int
    fingerprint: str
    source: str = "the tokens"
    tokenizer: str = BYTES
    eos: int | None = None

    def __len__(self) -> int:
        return self.values.numel()

    @classmethod
    def from_tensor(
        cls,
        values: torch.Tensor,
        vocab: int = BYTE_VOCAB,
        source: str = "the tokens",
        tokenizer: str = BYTES,
        eos: int | None = None,
    ) -> Tokens:
        """Tokens held in memory (e.g. in tests); the fingerprint hashes all of them, so it is
        the digest a token file of the same tokens (in the same dtype) holds."""
        import torch

        dtypes = (torch.uint8, torch.uint16, torch.uint32)
        if values.dim() != 1 or values.dtype not in dtypes:
            raise ValueError(
                f"tokens must be a 1-D uint8, uint16 or uint32 tensor, got {values.dim()}-D "
                f"{values.dtype}: use torch.frombuffer(bytearray(text), dtype=torch.uint8)"
            )
        values = values.contiguous().cpu()
        return cls(values, vocab, digest_of(values), source, tokenizer, eos)

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
        source = f"{self.source} ({which})"
        values = self.values[start:stop]
        return Tokens(values, self.vocab, fingerprint, source, self.tokenizer, self.eos)


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
    if whole[: header.size].tolist() != list(header.pack()):
        raise ValueError(f"{path} changed while it was read: read it again")
    values = whole[header.size :].view(getattr(torch, header.dtype))  # the header keeps alignment
    return Tokens(values, header.vocab, header.digest, str(path), header.tokenizer, header.eos)


def check_digest(path: str | os.PathLike, tokens: Tokens) -> None:
    """Raise if ``tokens`` (read from ``path``, e.g. with ``verify=False``) do not match their
    header's digest: the check ``check_token_file`` makes on the file, made on the tensor."""
    if digest_of(tokens.values) != tokens.fingerprint:
        raise _damaged(path)
