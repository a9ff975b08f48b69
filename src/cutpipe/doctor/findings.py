"""What one check says: a ``Finding``, and the four ways a finding can stand.

A finding says what was seen, whether it is fine ("ok"), could be better ("advice"), is likely
hurting ("warning") or could not be looked at here ("unchecked"), what to do and why, in one
sentence each, so the table, the JSON and the start-up lines all print the same words.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from cutpipe.doctor.gathering import Machine

OK, ADVICE, WARNING, UNCHECKED = "ok", "advice", "warning", "unchecked"
STATUSES = (OK, ADVICE, WARNING, UNCHECKED)


@dataclass(frozen=True)
class Finding:
    """One check: what was seen, how it stands, what to do about it and why."""

    name: str
    value: str
    status: str  # one of STATUSES
    advice: str  # what to do ("" when nothing is)
    why: str  # one sentence

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}, not {self.status!r}")

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def unchecked_without_gpu(name: str, machine: Machine, value: str = "not checked") -> Finding:
    """The finding of a check that needs a GPU on a machine where none was seen or probed."""
    return Finding(
        name, value, UNCHECKED, "run cutpipe doctor on a GPU node",
        f"it needs a GPU, and {machine.no_gpu}.",
    )  # fmt: skip
