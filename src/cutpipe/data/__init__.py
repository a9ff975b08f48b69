"""Training data for ``cutpipe train``: a text corpus as byte tokens, in seeded batches.

``corpus`` picks the files (the user's, or the standard library's own sources), ``entries``
reads them without hanging on pipes or devices and counts what it skips, ``tokens`` writes,
checks and maps token files, ``prepare`` joins them (and ``load_tokens`` gives a run its tokens
from a token file or from text), ``check`` looks at ``--data`` before workers start
(``check_data``, no torch), ``entropy`` gives the unigram entropy (the loss a context-free model
cannot beat), ``loader`` yields resumable, replica-split batches and ``heldout`` a validation
set's, the same every time.
Importing this package never imports torch; the functions that need it import it when called.
"""

from cutpipe.data.check import DataSummary, check_data
from cutpipe.data.corpus import SEPARATOR, STDLIB_BYTES, Source, stdlib_sources, user_sources
from cutpipe.data.entries import Skipped
from cutpipe.data.entropy import nats_to_bits, unigram_entropy
from cutpipe.data.loader import TokenLoader
from cutpipe.data.prepare import Prepared, load_tokens, prepare
from cutpipe.data.tokens import (
    BYTE_VOCAB,
    HEADER_SIZE,
    Header,
    Tokens,
    check_digest,
    check_token_file,
    is_token_file,
    read_header,
    read_tokens,
    write_tokens,
)

__all__ = [
    "BYTE_VOCAB",
    "HEADER_SIZE",
    "SEPARATOR",
    "STDLIB_BYTES",
    "DataSummary",
    "Header",
    "Prepared",
    "Skipped",
    "Source",
    "TokenLoader",
    "Tokens",
    "check_data",
    "check_digest",
    "check_token_file",
    "is_token_file",
    "load_tokens",
    "nats_to_bits",
    "prepare",
    "read_header",
    "read_tokens",
    "stdlib_sources",
    "unigram_entropy",
    "user_sources",
    "write_tokens",
]
