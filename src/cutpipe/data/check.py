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
from cutpipe.data.prepare import Paths, TextCorpus, as_paths, token_file_of
from cutpipe.data.tokens import check_token_file


@dataclass(frozen=True)
class DataSummary:
    """What ``--data`` holds: where it is (``corpus``), a ``"token file"`` or ``"text"``, how
    many tokens from how many files, their digest (the fingerprint checkpoints carry), and what
    the walk of text folders skipped."""

    corpus: str
    kind: str
    tokens: int
    files: int
    digest: str
    skipped: Skipped = field(default_factory=Skipped)

    def __str__(self) -> str:
        """One line for the launcher to print."""
        if self.kind == "token file":
            return f"data: {self.corpus}, a token file of {self.tokens:,} tokens (digest checked)"
        files = f"{self.files:,} file{'s' if self.files != 1 else ''}"
        line = f"data: {self.tokens:,} tokens of text from {files} of {self.corpus}"
        return line + (f"; skipped {self.skipped}" if self.skipped.total else "")


def check_data(
    paths: str | os.PathLike[str] | Paths = (),
    *,
    max_bytes: int | None = None,
    seq_len: int | None = None,
    windows: int = 1,
) -> DataSummary:
    """Check ``--data`` (``paths``; default: the standard library corpus) as ``load_tokens``
    will read it, and sum it up; a one-line ValueError says what is wrong and what to change.

    With ``seq_len``, the tokens must also make at least ``windows`` windows of ``seq_len + 1``
    tokens (pass the global batch, batch size x data-parallel replicas, to check a whole one).
    """
    for name, value in (("seq_len", seq_len), ("windows", windows)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):  # fmt: skip
            raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
    paths = as_paths(paths)
    file = token_file_of(paths, max_bytes)
    if file is not None:
        header = check_token_file(file)
        summary = DataSummary(str(file), "token file", header.count, 1, header.digest)
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
    return summary
