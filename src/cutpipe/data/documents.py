"""The documents of one corpus file: a text file is one, a ``.jsonl`` or ``.parquet`` file
holds one per record.

A ``.jsonl`` file holds one JSON object per line whose text is the field ``text_field``
(``--text-field``, default ``text``); blank lines are passed over. A line that is not JSON, is not
an object, lacks the field or holds something other than a string there is an error naming
``file:line``: a dataset that half parses is a dataset to fix, not to train on in part. A
``.parquet`` file is read with ``pyarrow`` (optional: ``pip install 'cutpipe[data]'``) a batch of
rows at a time, only the ``text_field`` column, never the whole file; a missing column, a column
that is not text, and a null in it are errors naming the file (and the row). Empty documents are
left out, as empty text files are. Documents come as UTF-8 bytes. No torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

#: Rows read from a parquet file at a time.
PARQUET_BATCH = 1024
#: File endings read as records, one document each, rather than as one text.
RECORD_KINDS = {".jsonl": "jsonl", ".parquet": "parquet"}

Advance = Callable[[int], None]


def record_kind(path: Path) -> str | None:
    """``"jsonl"`` or ``"parquet"`` for a file of records, None for a text file."""
    return RECORD_KINDS.get(path.suffix.lower())


def jsonl_documents(file: BinaryIO, name: str, field: str, advance: Advance) -> Iterator[bytes]:
    """The ``field`` of each line's object in ``file`` (named ``name`` in errors)."""
    for number, line in enumerate(file, 1):
        advance(len(line))
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise ValueError(
                f"{name}:{number} is not JSON: a .jsonl file holds one JSON object per line"
            ) from None
        if not isinstance(record, dict) or field not in record:
            raise ValueError(
                f"{name}:{number} has no {field!r} field: name the field that holds the text "
                "with --text-field"
            )
        text = record[field]
        if not isinstance(text, str):
            raise ValueError(
                f"{name}:{number}: its {field!r} is {type(text).__name__}, not text: name the "
                "field that holds the text with --text-field"
            )
        if text:
            yield text.encode("utf-8", errors="replace")


def parquet_documents(
    file: BinaryIO, name: str, field: str, advance: Advance, size: int
) -> Iterator[bytes]:
    """The ``field`` column of each row of the parquet ``file`` (``size`` bytes: what
    ``advance`` is told in all, row by row)."""
    from cutpipe.data.tokenizer import require

    pa = require("pyarrow", f"reading {name} (a .parquet file)")
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(file)
    except (pa.ArrowException, OSError) as error:
        first = (str(error).splitlines() or [type(error).__name__])[0]
        raise ValueError(f"{name} is not a parquet file ({first}): give a .parquet file") from None
    schema = parquet.schema_arrow
    if field not in schema.names:
        raise ValueError(
            f"{name} has no {field!r} column (it has {', '.join(schema.names) or 'none'}): name "
            "the column that holds the text with --text-field"
        )
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
            or getattr(pa.types, "is_string_view", lambda _: False)(kind)):  # fmt: skip
        raise ValueError(
            f"{name}: its {field!r} column holds {kind}, not text: name the column that holds "
            "the text with --text-field"
        )
    rows = max(1, parquet.metadata.num_rows)
    row, told = 0, 0
    for batch in parquet.iter_batches(batch_size=PARQUET_BATCH, columns=[field]):
        column = batch.column(0)
        if column.null_count:
            first_null = next(
                i for i, valid in enumerate(column.is_valid().to_pylist()) if not valid
            )
            raise ValueError(
                f"{name}: row {row + first_null + 1} has no {field!r} (null): fill it or drop the "
                "row"
            )
        for text in column.to_pylist():
            if text:
                yield text.encode("utf-8", errors="replace")
        row += len(column)
        now = size * row // rows
        advance(now - told)
        told = now
