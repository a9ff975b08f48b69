"""A Hugging Face tokenizer (``tokenizer.json``) for ``--tokenizer``: its identity, its
end-of-sequence token, and documents turned into packed token ids.

The ``tokenizers`` package is an optional dependency (``pip install 'cutpipe[data]'``); without
``--tokenizer`` nothing here is imported and the tokens are bytes. A tokenizer is named by the
SHA-256 of its canonical JSON (``Tokenizer.to_str()``), not of the file: the same tokenizer saved
with other whitespace is the same tokenizer, and a token file's header keeps that digest so a run
given another tokenizer is refused.

Each document is encoded without the tokenizer's own special tokens (no BOS a post-processor
would add) and followed by the end-of-sequence token, which tells the model where a document
ends. The EOS token is ``--eos TOKEN`` when given; else the ``eos_token`` of a model folder's
``tokenizer_config.json``; else the first of ``EOS_CANDIDATES`` the vocabulary holds.
"""

from __future__ import annotations

import array
import hashlib
import json
import os
import sys
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from cutpipe.data.tokens import DTYPES, dtype_for

#: End-of-sequence tokens of common tokenizers, tried in this order when none is named.
EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<|im_end|>", "<eos>", "<|eos|>")
_INSTALL = "pip install 'cutpipe[data]'"
_PARALLELISM = "TOKENIZERS_PARALLELISM"
#: array typecodes by item size: the tokens' dtype packed without numpy.
_TYPECODES = {array.array(code).itemsize: code for code in ("L", "I", "H", "B")}


def require(module: str, why: str) -> Any:
    """Import ``module`` (``tokenizers`` or ``pyarrow``), or a one-line error saying how to get
    it; ``why`` says what needs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(f"{why} needs the {module} package: {_INSTALL}") from None


def tokenizer_file(path: str | os.PathLike[str]) -> Path:
    """The ``tokenizer.json`` that ``path`` names: the file itself, or the one in a folder."""
    given = Path(path)
    file = given / "tokenizer.json" if given.is_dir() else given
    if not file.is_file():
        where = f"{given} holds no tokenizer.json" if given.is_dir() else f"{given} does not exist"
        raise ValueError(
            f"--tokenizer {path}: {where}: give a Hugging Face tokenizer.json or a model folder "
            "that holds one"
        )
    return file


@dataclass(frozen=True)
class TextTokenizer:
    """A loaded ``tokenizer.json``: where it is, its digest, vocabulary and EOS token."""

    file: Path
    digest: str
    vocab: int
    eos: int
    eos_token: str

    @property
    def dtype(self) -> str:
        """The dtype its ids are stored in (``tokens.dtype_for``)."""
        return dtype_for(self.vocab)

    def encode(self, documents: Sequence[str]) -> bytes:
        """The ids of ``documents``, each followed by EOS, packed little-endian in ``dtype``."""
        return _encode(str(self.file), self.digest, self.eos, self.dtype, list(documents))


def load_tokenizer(path: str | os.PathLike[str], eos: str | None = None) -> TextTokenizer:
    """The tokenizer at ``path`` (a ``tokenizer.json`` or a folder holding one) with its EOS
    token: ``eos`` when given, else found (module docstring); one line when none is found."""
    file = tokenizer_file(path)
    tokenizer, digest = _loaded(str(file))
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    size = max(tokenizer.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=0) + 1)
    if eos is not None:
        if eos not in vocab:
            raise ValueError(
                f"--eos {eos}: {file} has no such token: give one of its tokens (e.g. "
                f"{_special_tokens(tokenizer) or 'its end-of-text token'})"
            )
        token = eos
    else:
        token = _configured_eos(file, vocab) or next(
            (t for t in EOS_CANDIDATES if t in vocab), None
        )
        if token is None:
            raise ValueError(
                f"{file}: cannot tell its end-of-sequence token (none of "
                f"{', '.join(EOS_CANDIDATES)}; its special tokens: "
                f"{_special_tokens(tokenizer) or 'none'}): name it with "
                "`cutpipe data prepare --eos TOKEN`"
            )
    return TextTokenizer(file, digest, size, vocab[token], token)


def tokenizer_digest(path: str | os.PathLike[str]) -> str:
    """The digest of the tokenizer at ``path`` (``TextTokenizer.digest``), whatever its EOS."""
    return _loaded(str(tokenizer_file(path)))[1]


def _configured_eos(file: Path, vocab: dict[str, int]) -> str | None:
    """The ``eos_token`` of the ``tokenizer_config.json`` beside ``file``, if it is a token."""
    config = file.with_name("tokenizer_config.json")
    try:
        token = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(token, dict):  # {"content": "</s>", ...} in older configs
        token = token.get("content")
    return token if isinstance(token, str) and token in vocab else None


def _special_tokens(tokenizer: Any) -> str:
    decoder = tokenizer.get_added_tokens_decoder()
    return ", ".join(t.content for _, t in sorted(decoder.items()) if t.special)


def _loaded(file: str) -> tuple[Any, str]:
    """The ``tokenizers.Tokenizer`` of ``file`` and its digest, loaded once per process while
    the file stays as it is (a file rewritten in place is loaded again)."""
    try:
        stat = os.stat(file)
    except OSError as error:
        raise ValueError(f"cannot read {file}: {error.strerror}") from None
    return _load(file, stat.st_mtime_ns, stat.st_size)


@cache
def _load(file: str, mtime_ns: int, size: int) -> tuple[Any, str]:
    """``_loaded``'s work, kept per version of the file."""
    tokenizers = require("tokenizers", "--tokenizer")
    try:
        tokenizer = tokenizers.Tokenizer.from_file(file)
    except Exception as error:  # the library raises a bare Exception for a malformed file
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(f"{file} is not a Hugging Face tokenizer.json: {first}") from None
    return tokenizer, hashlib.sha256(tokenizer.to_str().encode("utf-8")).hexdigest()


def _encode(file: str, digest: str, eos: int, dtype: str, documents: list[str]) -> bytes:
    """What ``TextTokenizer.encode`` does: ``file``'s tokenizer, loaded once, must still be the
    one of ``digest``."""
    tokenizer, loaded = _loaded(file)
    if loaded != digest:
        raise ValueError(f"{file} changed while the corpus was tokenized: run again")
    ids = array.array(_TYPECODES[DTYPES[dtype][0]])
    # without the character offsets, which nothing here reads (tokenizers >= 0.20)
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    for encoding in encode(documents, add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.append(eos)
    if sys.byteorder != "little":  # pragma: no cover - token files are little-endian
        ids.byteswap()
    return ids.tobytes()


@contextmanager
def _serial_encoding() -> Iterator[None]:
    """Each ``encode_batch`` on the calling thread alone (the library reads
    ``TOKENIZERS_PARALLELISM`` at every call): ``encode_stream``'s threads are the parallelism."""
    before = os.environ.get(_PARALLELISM)
    os.environ[_PARALLELISM] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(_PARALLELISM, None)
        else:
            os.environ[_PARALLELISM] = before


def encode_stream(
    tokenizer: TextTokenizer, batches: Iterable[list[str]], workers: int = 1
) -> Iterator[bytes]:
    """The packed ids of each batch of documents, in order.

    With ``workers`` > 1, that many threads encode a batch each (the library releases the GIL
    while it encodes, so they run on as many cores) while this one reads the next batches; at
    most two batches per worker are in flight, so memory holds a few batches, not the corpus.
    Threads, not processes: nothing is imported again or forked, so this is safe from any
    script and inside a training worker. With 1, each batch is encoded here, by the library's
    own threads."""
    if workers <= 1:
        for batch in batches:
            yield tokenizer.encode(batch)
        return
    from concurrent.futures import Future, ThreadPoolExecutor

    pending: deque[Future[bytes]] = deque()
    with _serial_encoding(), ThreadPoolExecutor(workers, "cutpipe-tokenize") as pool:
        try:
            for batch in batches:
                pending.append(pool.submit(tokenizer.encode, batch))
                if len(pending) >= 2 * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()
