"""Training data for ``cutpipe train``: a text corpus as byte tokens or a Hugging Face
tokenizer's ids, in seeded batches.

``corpus`` picks the files (the user's, or the standard library's own sources), ``entries``
reads them without hanging on pipes or devices and counts what it skips, ``documents`` reads the
records of ``.jsonl`` and ``.parquet`` files, ``tokenizer`` loads a ``tokenizer.json`` (optional
``tokenizers`` package) and encodes documents with it, ``tokens`` writes,
checks and maps token files, ``prepare`` joins them (and ``load_tokens`` gives a run its tokens
from a token file or from text), ``check`` looks at ``--data`` before workers start
(``check_data``, no torch), ``entropy`` gives the unigram entropy (the loss a context-free model
cannot beat), ``loader`` yields resumable, replica-split batches and ``heldout`` a validation
set's, the same every time.
Importing this package never imports torch; the functions that need it import it when called.
"""

from cutpipe.data.check import DataSummary, check_data, check_vocab
from cutpipe.data.corpus import SEPARATOR, STDLIB_BYTES, Source, stdlib_sources, user_sources
from cutpipe.data.entries import Skipped
from cutpipe.data.entropy import nats_to_bits, unigram_entropy
from cutpipe.data.loader import TokenLoader
from cutpipe.data.prepare import Prepared, check_tokenizer, load_tokens, prepare
from cutpipe.data.tokenizer import TextTokenizer, load_tokenizer, tokenizer_digest
from cutpipe.data.tokens import (
    BYTE_VOCAB,
    BYTES,
    DTYPES,
    HEADER_SIZE,
    HEADER_SIZES,
    Header,
    Tokens,
    check_digest,
    check_token_file,
    dtype_for,
    is_token_file,
    read_header,
    read_tokens,
    write_tokens,
)

__all__ = [
    "BYTES",
    "BYTE_VOCAB",
    "DTYPES",
    "HEADER_SIZE",
    "HEADER_SIZES",
    "SEPARATOR",
    "STDLIB_BYTES",
    "DataSummary",
    "Header",
    "Prepared",
    "Skipped",
    "Source",
    "TextTokenizer",
    "TokenLoader",
    "Tokens",
    "check_data",
    "check_digest",
    "check_token_file",
    "check_tokenizer",
    "check_vocab",
    "dtype_for",
    "is_token_file",
    "load_tokenizer",
    "load_tokens",
    "nats_to_bits",
    "prepare",
    "read_header",
    "read_tokens",
    "stdlib_sources",
    "tokenizer_digest",
    "unigram_entropy",
    "user_sources",
    "write_tokens",
]
