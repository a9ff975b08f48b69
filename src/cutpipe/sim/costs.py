"""``Costs``: how long each op takes and how much memory and traffic it makes.

Times and sizes are per *stage* of the schedule being simulated: a V-shape stage is half a 1F1B
stage, so it is given its own (usually halved) cost. A scalar applies to every stage; a sequence
gives one value per stage.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

from cutpipe.schedule.codes import BW_CODE, KIND_BITS, KIND_MASK
from cutpipe.schedule.schedule import Schedule
from cutpipe.schedule.validate import Timing

PerStage = float | Sequence[float]

#: The largest cost any field may take: sums over a schedule's million ops and the products
#: of the metrics stay finite far below the float range (a cost of 1e308 would make them inf).
MAX_COST = 1e15
#: What activation recompute keeps, per layer: everything, the outputs of the expensive ops, or
#: the layer's inputs only. The runtime runs these modes (``cutpipe.runtime.compute.recompute``)
#: and the planner prices them (``cutpipe.plan.costs``): one list for both.
RECOMPUTE_MODES = ("none", "selective", "full")
#: The fields ``Costs.parse`` reads (``params`` is per stage only, given in Python).
PARSED = ("f", "b", "w", "fb", "comm", "ep_f", "ep_b", "activation", "w_memory", "p2p_bytes",
          "ep_bytes")  # fmt: skip
#: The fields that may be None.
OPTIONAL = ("fb", "params")
#: The fields that take one value per stage (or one for all stages).
PER_STAGE = ("f", "b", "w", "ep_f", "ep_b", "activation", "params")


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"cost {name} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or not 0 <= value <= MAX_COST:
        raise ValueError(
            f"cost {name} must be a finite number between 0 and {MAX_COST:g}, got {value!r}"
        )


def _check_field(name: str, value: object) -> None:
    """A TypeError or ValueError naming the field if ``value`` cannot be its cost."""
    if value is None:
        if name not in OPTIONAL:
            raise TypeError(f"cost {name} must be a number, got None")
        return
    if name in PER_STAGE and isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if not value:
            raise ValueError(f"cost {name} lists no values: give one per stage, or one number")
        for index, item in enumerate(value):
            _check_number(f"{name}[{index}]", item)
        return
    if name == "params":
        raise TypeError(f"cost params must be a list of per-stage sizes or None, got {value!r}")
    _check_number(name, value)


@dataclass(frozen=True)
class Costs:
    """The cost model of the simulator.

    Attributes:
        f, b, w: time of a forward, an input-gradient backward and a weight-gradient backward.
            A full backward (BW) takes b + w.
        fb: time of an overlapped F&B pair. None: the pair's compute (F plus its backward) or its
            two all-to-alls, whichever is longer, i.e. communication fully hidden.
        comm: point-to-point latency added to every input that crosses ranks.
        ep_f, ep_b: expert-parallel all-to-all time inside each F and each B / BW, per stage.
            Exposed (added to the op's time) unless the op runs in an overlapped pair.
        activation: memory an F leaves live, in units of one stage-microbatch activation.
        w_memory: fraction of that activation a B keeps for its W (the W frees it).
        params: parameter size of each stage; None: all stages equal.
        p2p_bytes: size of one tensor crossing a stage boundary (activation or its gradient).
        ep_bytes: bytes one expert-parallel all-to-all moves (one per F and one per backward).
    """

    f: PerStage = 1.0
    b: PerStage = 1.0
    w: PerStage = 1.0
    fb: float | None = None
    comm: float = 0.0
    ep_f: PerStage = 0.0
    ep_b: PerStage = 0.0
    activation: PerStage = 1.0
    w_memory: float = 0.5
    params: Sequence[float] | None = None
    p2p_bytes: float = 1.0
    ep_bytes: float = 0.0

    def __post_init__(self) -> None:
        for field in fields(self):
            _check_field(field.name, getattr(self, field.name))
        if not 0 <= self.w_memory <= 1:
            raise ValueError(
                f"cost w_memory is the fraction of an activation a B keeps for its W, between 0 "
                f"and 1, got {self.w_memory}"
            )
        if self.params is not None and not sum(self.params) > 0:
            raise ValueError(f"cost params must have a positive total, got {list(self.params)}")

    @classmethod
    def parse(cls, text: str) -> Costs:
        """Read ``"F=1,B=1,W=1,FB=2.5,comm=0.1"``; keys are the field names, any case.

        Every key at most once; ``FB=none`` asks for the default pair time.
        """
        names = {name.lower(): name for name in PARSED}
        values: dict[str, float | None] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, raw = item.partition("=")
            name = names.get(key.strip().lower())
            if not sep or name is None:
                raise ValueError(
                    f"cannot read cost {item!r}: expected KEY=VALUE with KEY one of "
                    f"{', '.join(PARSED)}"
                )
            if name in values:
                raise ValueError(f"cost {name} is given twice in {text!r}: give each key once")
            raw = raw.strip()
            if name in OPTIONAL and raw.lower() == "none":
                values[name] = None
                continue
            try:
                values[name] = float(raw)
            except ValueError:
                raise ValueError(f"cost {key.strip()}={raw!r} is not a number") from None
        return cls(**values)

    def scaled(self, factor: float) -> Costs:
        """The same model with every stage's compute and EP time multiplied by ``factor``.

        Used to give the stages of a schedule with S stages on R ranks R/S of the time,
        activation and expert-parallel volume of a 1F1B stage (a V's stages: half).
        Boundary tensors keep their size.
        """

        def times(value: PerStage) -> PerStage:
            return (
                value * factor if not isinstance(value, Sequence) else [v * factor for v in value]
            )

        return replace(
            self,
            f=times(self.f),
            b=times(self.b),
            w=times(self.w),
            fb=None if self.fb is None else self.fb * factor,
            ep_f=times(self.ep_f),
            ep_b=times(self.ep_b),
            activation=times(self.activation),
            ep_bytes=self.ep_bytes * factor,
        )

    def per_stage(self, name: str, num_stages: int) -> list[float]:
        """One value of the per-stage field ``name`` for each of ``num_stages`` stages."""
        value = getattr(self, name)
        if value is None:
            return [1.0] * num_stages
        if isinstance(value, Sequence):
            if len(value) != num_stages:
                raise ValueError(
                    f"cost {name} lists {len(value)} values but the schedule has {num_stages} stages"
                )
            return [float(v) for v in value]
        return [float(value)] * num_stages

    def has_ep(self) -> bool:
        """Whether any op carries expert-parallel all-to-all time."""
        return any(
            v
            for value in (self.ep_f, self.ep_b)
            for v in (value if isinstance(value, Sequence) else [value])
        )

    def is_uniform(self, num_stages: int) -> bool:
        return all(len(set(self.per_stage(n, num_stages))) == 1 for n in ("f", "b", "w"))

    def timing(self, schedule: Schedule) -> Timing:
        """Per-slot duration tables for ``walk``."""
        S, m = schedule.num_stages, schedule.num_microbatches
        f, b, w, ep_f, ep_b = (self.per_stage(n, S) for n in ("f", "b", "w", "ep_f", "ep_b"))
        forward = [x + e for x, e in zip(f, ep_f, strict=True)]
        backward = [x + e for x, e in zip(b, ep_b, strict=True)]
        full = [x + y + e for x, y, e in zip(b, w, ep_b, strict=True)]
        overlap = self.fb

        def pair(forward_code: int, backward_code: int) -> float:
            if overlap is not None:
                return overlap
            fs = (forward_code >> KIND_BITS) % S
            bs = (backward_code >> KIND_BITS) % S
            grad = b[bs] + w[bs] if backward_code & KIND_MASK == BW_CODE else b[bs]
            return max(f[fs] + grad, ep_f[fs] + ep_b[bs])

        return Timing(forward * m, backward * m, w * m, full * m, pair, self.comm)
