"""The launcher's look at ``--data`` before any worker starts, without torch.

Workers that each find the data unusable fail one by one, after the processes started and maybe
after a model was built; ``check_data`` finds the same problems first, in the launcher, and says
them once in one line: a missing path, a named pipe, a damaged token file (every token compared
with the header's digest, as ``cutpipe data info`` does), text paths that hold no text, too few
tokens for one window. It reads ``--data`` the way the workers will (``prepare.token_file_of``,
``prepare.TextCorpus``), so what it accepts they accept, and its summary carries the digest the
run's checkpoints will name and what the walk skipped.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field

from cutpipe.data.entries import Skipped
from cutpipe.data.loader import check_windows
from cutpipe.data.prepare import (
    Paths,
    TextCorpus,
    as_paths,
    batches,
    check_tokenizer,
    token_file_of,
)
from cutpipe.data.tokens import BYTE_VOCAB, BYTES, DTYPES, check_token_file


@dataclass(frozen=True)
class DataSummary:
    """What ``--data`` holds: where it is (``corpus``), a ``"token file"`` or ``"text"``, how
    many tokens from how many files, their digest (the fingerprint checkpoints carry), what
    the walk of text folders skipped, and the vocabulary and tokenizer (its digest, or
    ``BYTES``) of the tokens."""

    corpus: str
    kind: str
    tokens: int
    files: int
    digest: str
    skipped: Skipped = field(default_factory=Skipped)
    vocab: int = BYTE_VOCAB
    tokenizer: str = BYTES

    def __str__(self) -> str:
        """One line for the launcher to print."""
        made = "" if self.tokenizer == BYTES else f" of the tokenizer {self.tokenizer[:16]}"
        if self.kind == "token file":
            return (
                f"data: {self.corpus}, a token file of {self.tokens:,} tokens{made} (digest "
                "checked)"
            )
        files = f"{self.files:,} file{'s' if self.files != 1 else ''}"
        line = f"data: {self.tokens:,} tokens{made} of text from {files} of {self.corpus}"
        return line + (f"; skipped {self.skipped}" if self.skipped.total else "")


def check_data(
    paths: str | os.PathLike[str] | Paths = (),
    *,
    max_bytes: int | None = None,
    seq_len: int | None = None,
    windows: int = 1,
    tokenizer: str | os.PathLike[str] | None = None,
    vocab: int | None = None,
) -> DataSummary:
    """Check ``--data`` (``paths``; default: the standard library corpus) as ``load_tokens``
    will read it, and sum it up; a one-line ValueError says what is wrong and what to change.

    With ``seq_len``, the tokens must also make at least ``windows`` windows of ``seq_len + 1``
    tokens (pass the global batch, batch size x data-parallel replicas, to check a whole one).
    With ``tokenizer`` (``--tokenizer``), a token file must be of that tokenizer, and text is
    tokenized by it to count its tokens; with ``vocab`` (the model's), the data's vocabulary
    must fit in it (``check_vocab``).
    """
    for name, value in (("seq_len", seq_len), ("windows", windows)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):  # fmt: skip
            raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
    paths = as_paths(paths)
    file = token_file_of(paths, max_bytes)
    if file is not None:
        header = check_token_file(file)
        if tokenizer is not None:
            check_tokenizer(header.tokenizer, str(file), tokenizer)
        summary = DataSummary(
            str(file), "token file", header.count, 1, header.digest, Skipped(), header.vocab,
            header.tokenizer,
        )  # fmt: skip
    elif tokenizer is not None:  # encoded as the workers will, to count the tokens
        from cutpipe.data.tokenizer import encode_stream, load_tokenizer

        loaded = load_tokenizer(tokenizer)
        corpus = TextCorpus(paths, max_bytes)
        digest, size = hashlib.sha256(), 0
        for chunk in encode_stream(loaded, batches(corpus.documents())):
            digest.update(chunk)
            size += len(chunk)
        if size == 0:
            raise corpus.no_text()
        count = size // DTYPES[loaded.dtype][0]
        summary = DataSummary(
            corpus.name, "text", count, corpus.files, digest.hexdigest(), corpus.skipped,
            loaded.vocab, loaded.digest,
        )  # fmt: skip
    else:
        corpus = TextCorpus(paths, max_bytes)
        digest = hashlib.sha256()
        for chunk in corpus.chunks():
            digest.update(chunk)
        if corpus.size == 0:
            raise corpus.no_text()
        summary = DataSummary(
            corpus.name, "text", corpus.size, corpus.files, digest.hexdigest(), corpus.skipped
        )
    if seq_len is not None:
        check_windows(summary.tokens, seq_len, summary.corpus, windows)
    if vocab is not None:
        check_vocab(vocab, summary.vocab, summary.tokenizer, summary.corpus)
    return summary


def check_vocab(model: int, data: int, tokenizer: str, source: str) -> None:
    """A one-line ValueError if a model's vocabulary of ``model`` tokens cannot embed the
    ``data``-token vocabulary of ``source``'s tokens (made by ``tokenizer``, a digest or
    ``BYTES``)."""
    if model >= data:
        return
    made = "byte tokens" if tokenizer == BYTES else f"tokens of the tokenizer {tokenizer[:16]}"
    raise ValueError(
        f"{source} holds {made}, a vocabulary of {data:,}, larger than the model's vocab "
        f"{model:,}: set the model's vocab to at least {data:,}, or prepare the data with a "
        "tokenizer that fits it"
    )
