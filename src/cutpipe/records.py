"""Reading records (dicts from JSON files) with errors that name the field and say what is wrong.

A file written by hand or cut short should fail with "timeline: missing 'ends'", not with a
``KeyError`` or a ``TypeError`` from deep inside. No imports from the rest of cutpipe.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any


def mapping(data: Any, what: str) -> Mapping[str, Any]:
    """``data`` if it is a JSON object (a dict), else a ValueError."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{what} must be a JSON object (a dict), got {type(data).__name__}")
    return data


def require_keys(data: Any, what: str, keys: Iterable[str]) -> Mapping[str, Any]:
    """``data`` as a mapping holding every one of ``keys``; a ValueError lists the missing."""
    record = mapping(data, what)
    missing = [key for key in keys if key not in record]
    if missing:
        raise ValueError(f"{what} lacks {', '.join(repr(k) for k in missing)}")
    return record


def whole(value: Any, what: str, least: int = 0) -> int:
    """An int (not a bool) of at least ``least``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be a whole number, got {value!r}")
    if value < least:
        raise ValueError(f"{what} must be >= {least}, got {value}")
    return value


def check_count(value: Any, what: str, least: int = 1) -> int:
    """Check an argument that counts something (ranks, microbatches, devices) and return it: an
    int, not a bool, a TypeError otherwise; at least ``least``, a ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {value!r} ({type(value).__name__})")
    if value < least:
        raise ValueError(f"{what} must be >= {least}, got {value}")
    return value


def finite(value: Any, what: str) -> float:
    """A finite real number (not a bool), as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    return float(value)


def listed(value: Any, what: str, length: int | None = None) -> list:
    """A JSON array (list or tuple) of ``length`` items, if given."""
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{what} must be a list, got {type(value).__name__}")
    if length is not None and len(value) != length:
        raise ValueError(f"{what} lists {len(value)} items, expected {length}")
    return list(value)
