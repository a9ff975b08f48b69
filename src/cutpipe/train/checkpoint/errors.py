"""The errors a checkpoint raises.

A save or a load is collective, so an error must stop every rank alike: a rank that raised alone
would leave the others waiting in their next collective forever.
"""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or completed; every rank raises the same message."""
