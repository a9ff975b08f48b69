"""What the caller fixed of the layout: the pipeline, data, expert and context-parallel sizes and
the chunks of interleaved schedules. ``recommend`` searches the rest.

Each forced value is checked against the job before anything is enumerated, so that one that
leaves no layout at all is refused by name (``PP=7 does not divide the 64 devices``) rather than
reported as a search that found nothing.

Context parallelism (CP) splits every sequence over ``cp`` ranks. Causal attention does more
work late in a sequence than early, so the sequence is cut into ``2*cp`` equal chunks and rank
``i`` takes chunks ``i`` and ``2*cp - 1 - i`` (the load-balanced ring attention of Megatron's
context parallelism): the sequence length must divide by ``2*cp``. CP is never searched; it is 1
unless given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cutpipe.plan.recommend.job import Job
from cutpipe.plan.recommend.plans import chunk_parameter, label, takes_chunks
from cutpipe.records import check_count
from cutpipe.schedule.registry import schedule_info


@dataclass(frozen=True)
class Force:
    """Layout dimensions fixed by the caller; None: searched (CP: 1 unless given)."""

    pp: int | None = None
    dp: int | None = None
    ep: int | None = None
    cp: int = 1
    chunks: int | None = None

    @classmethod
    def checked(
        cls, job: Job, schedules: Sequence[str], tp: int | None = None, *, pp: int | None = None,
        dp: int | None = None, ep: int | None = None, cp: int | None = None,
        chunks: int | None = None,
    ) -> Force:  # fmt: skip
        """The forced values, each refused by name where it leaves no layout of ``job``."""
        for name, value in (("pp", pp), ("dp", dp), ("ep", ep), ("cp", cp), ("chunks", chunks)):
            if value is not None:
                check_count(value, name)
        force = cls(pp, dp, ep, 1 if cp is None else cp, chunks)
        force.check_devices(job, tp)
        force.check_sequence(job)
        force.check_experts(job)
        force.check_chunks(schedules)
        return force

    def check_devices(self, job: Job, tp: int | None) -> None:
        devices = job.devices
        given = [(n, v) for n, v in (("PP", self.pp), ("DP", self.dp), ("TP", tp), ("CP", self.cp))
                 if v is not None and (n != "CP" or v > 1)]  # fmt: skip
        for name, value in given:
            if devices % value:
                raise ValueError(f"{name}={value} does not divide the {devices} devices")
        product = 1
        for _, value in given:
            product *= value
        words = " x ".join(f"{n}={v}" for n, v in given)
        if devices % product:
            raise ValueError(f"{words} = {product} does not divide the {devices} devices")
        if self.pp is not None and self.dp is not None and tp is not None and product != devices:
            raise ValueError(
                f"{words} is {product} devices, not the {devices} given: change one of them"
            )

    def check_sequence(self, job: Job) -> None:
        cp, length = self.cp, job.model.seq_len
        if cp > 1 and length % (2 * cp):
            raise ValueError(
                f"CP={cp} cuts each sequence into 2*CP={2 * cp} equal chunks (two per rank, "
                f"balancing causal attention), but {length:,} tokens do not divide by {2 * cp}: "
                "pick a CP with 2*CP dividing the sequence length"
            )

    def check_experts(self, job: Job) -> None:
        ep, model = self.ep, job.model
        if ep is None or ep == 1:
            return
        if not model.moe:
            raise ValueError(f"EP={ep} needs routed experts, and {model.name} has none: drop it")
        if model.experts % ep:
            raise ValueError(f"EP={ep} does not divide the {model.experts} experts")
        if self.dp is not None and self.dp % ep:
            raise ValueError(
                f"EP={ep} does not divide DP={self.dp} (the expert-parallel groups are carved "
                "out of the data-parallel ranks)"
            )

    def check_chunks(self, schedules: Sequence[str]) -> None:
        chunks = self.chunks
        if chunks is None:
            return
        if not any(chunk_parameter(name) for name in schedules):
            raise ValueError(
                f"chunks={chunks} fixes the chunks of schedules that take them (interleaved, "
                f"loopedbfs, interleavedzb), and none of {', '.join(schedules)} does"
            )
        for name in schedules:
            key = chunk_parameter(name)
            if key and not takes_chunks(name) and schedule_info(name).settings[key] != chunks:
                raise ValueError(
                    f"{label(name)} names its chunks and chunks={chunks} asks for others: "
                    "drop one of them"
                )

    def allows(self, pp: int, dp: int) -> bool:
        return (self.pp is None or pp == self.pp) and (self.dp is None or dp == self.dp)

    def describe(self) -> str:
        """``PP=4, DP=2`` for what is forced; "" when nothing is."""
        parts = [(n, v) for n, v in (("PP", self.pp), ("DP", self.dp), ("EP", self.ep))
                 if v is not None]  # fmt: skip
        if self.cp > 1:
            parts.append(("CP", self.cp))
        if self.chunks is not None:
            parts.append(("chunks", self.chunks))
        return ", ".join(f"{n}={v}" for n, v in parts)
