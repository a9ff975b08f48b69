"""Which training settings ``recommend`` tries for a layout, and the best of them.

For each layout and schedule: TP inside a node (dividing the heads), recompute none, selective,
full (least work first), and ZeRO over the data-parallel ranks (ZeRO-1 only under a pipeline,
whose accumulated gradients ZeRO-2/3 would shard; all three without one), in bf16 or FP8.
Sequence parallelism (with TP) and the context-parallel size are fixed by the caller, not
searched.
Within one recompute level the first ZeRO stage that fits is kept (a higher one is never faster);
a level that fits with ZeRO-1 or less ends the search (more recompute is never faster).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cutpipe.plan.costs.model import Hardware, Training
from cutpipe.plan.costs.profile import Profile
from cutpipe.plan.recommend.plans import Plan, Rejected
from cutpipe.records import check_count
from cutpipe.sim.costs import RECOMPUTE_MODES
from cutpipe.spec import ModelSpec


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Search:
    """Which training settings ``recommend`` tries: fixed where the caller fixed them."""

    zero: int | None
    recompute: str | None
    fp8: bool
    tp: int | None
    measured: bool  # a profile fixes compute and activations: no recompute or TP to model
    sequence_parallel: bool = True  # with TP: norms and dropout split along the sequence
    cp: int = 1  # context-parallel ranks per sequence (``Force`` checks the value)

    @classmethod
    def checked(
        cls, zero: int | None, recompute: str | None, precision: str, tp: int | None,
        hardware: Hardware, model: ModelSpec, profile: Profile | None, *,
        sequence_parallel: bool = True, cp: int = 1,
    ) -> Search:  # fmt: skip
        if zero is not None and zero not in (0, 1, 2, 3):
            raise ValueError(f"zero must be 0, 1, 2 or 3, got {zero!r}")
        if recompute is not None and recompute not in RECOMPUTE_MODES:
            raise ValueError(
                f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {recompute!r}"
            )
        if precision not in ("bf16", "fp8"):
            raise ValueError(f"precision must be 'bf16' or 'fp8', got {precision!r}")
        if precision == "fp8" and not hardware.fp8_flops:
            raise ValueError(f"{hardware.name} has no FP8 tensor cores: use --precision bf16")
        if tp is not None:
            check_count(tp, "tp")
            if tp > hardware.gpus_per_node or model.heads % tp:
                raise ValueError(
                    f"tp must divide the {model.heads} heads and stay inside a node of "
                    f"{hardware.gpus_per_node} GPUs, got {tp}"
                )
        if not isinstance(sequence_parallel, bool):
            raise ValueError(f"sequence_parallel must be True or False, got {sequence_parallel!r}")
        check_count(cp, "cp")
        measured = profile is not None
        if measured and (
            precision == "fp8" or (tp or 1) > 1 or cp > 1 or recompute not in (None, "none")
        ):
            raise ValueError(
                "a profile measures compute and activations as they ran: recompute, FP8, TP "
                "and CP are not modelled on top of it (profile the setting instead)"
            )
        return cls(zero, recompute, precision == "fp8", tp, measured, sequence_parallel, cp)

    def shapes(self, devices: int, model: ModelSpec, hardware: Hardware) -> list[tuple[int, int]]:
        """(PP, TP) pairs to try: TP inside a node, dividing the heads and key/value heads, and
        leaving whole data-parallel groups of the devices beside TP and CP."""
        kv = model.kv_heads or model.heads
        if self.tp is not None:
            tps = [self.tp]
        elif self.measured:
            tps = [1]
        else:
            tps = [
                t for t in divisors(hardware.gpus_per_node) if model.heads % t == 0 and kv % t == 0
            ]
        return [
            (pp, tp)
            for tp in tps
            for pp in divisors(devices)
            if (devices // pp) % (tp * self.cp) == 0
        ]

    def settings(self, dp: int, tp: int, pp: int = 1) -> list[list[Training]]:
        """Groups by recompute level (least first), each by ZeRO stage (least first). Under a
        pipeline only ZeRO-1 is searched: ZeRO-2 and -3 shard gradients that a pipeline
        accumulates over its microbatches (DeepSpeed refuses the combination), and ZeRO-3's
        per-pass weight gathers would repeat for every microbatch; ask for them explicitly."""
        if self.recompute is not None:
            levels = [self.recompute]
        else:
            levels = ["none"] if self.measured else list(RECOMPUTE_MODES)
        # nothing to shard over one rank; ZeRO shards over DP x CP (``Training.sharding_ranks``)
        unsharded = [0] if dp * self.cp == 1 else [1] if pp > 1 else [1, 2, 3]
        zeros = [self.zero] if self.zero is not None else unsharded
        return [[self.training(z, dp, r, tp) for z in zeros] for r in levels]

    def training(self, zero: int, dp: int, recompute: str, tp: int) -> Training:
        """The setting with this search's precision, sequence parallelism and CP."""
        return Training(
            zero, dp, recompute, self.fp8, tp, sequence_parallel=self.sequence_parallel, cp=self.cp
        )


def best_setting(
    groups: Sequence[Sequence[Training]], attempt: Callable[[Training, bool], Plan | Rejected]
) -> Plan | Rejected:
    """The fastest plan over the settings (see the module), or the refusal that came closest.

    Within a group the settings are first weighed on the compute-balanced split; only when none
    fits does the closest get a memory-aware split (``attempt(training, True)``)."""
    best: Plan | None = None
    closest: Rejected | None = None

    def nearer(outcome: Rejected) -> bool:
        return closest is None or (0 < outcome.excess < closest.excess) or not closest.excess

    for group in groups:
        found, near = None, None
        for training in group:
            outcome = attempt(training, False)
            if isinstance(outcome, Plan):
                found = outcome
                break
            if near is None or 0 < outcome.excess < near.excess:
                near = outcome
        if found is None and near is not None and near.excess > 0:
            outcome = attempt(near.training, True)
            found = outcome if isinstance(outcome, Plan) else None
            near = near if found else outcome
        if found is not None and (best is None or found.tokens_per_second > best.tokens_per_second):
            best = found
        if found is None and near is not None and nearer(near):
            closest = near
        if best is not None and best.training.zero <= 1:
            break
    return best if best is not None else closest
