"""The schedules cutpipe knows by name, with what each needs, stores and takes as parameters.

A schedule is named by its registry name or one of its aliases (PyTorch's class names, with or
without the ``Schedule`` prefix, in any case), optionally followed by keyword parameters:
``interleaved:chunks=4`` in text, ``generate("interleaved", R, m, chunks=4)`` in Python.
``schedule_info`` returns the entry with its parameters bound, so ``accepts``,
``min_microbatches``, ``ops_bound`` and ``generate`` all answer for that choice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from cutpipe.schedule.generators import (
    dualpipe,
    dualpipev,
    gpipe,
    interleaved,
    interleaved_zb,
    looped_bfs,
    one_f_one_b,
    zb_h1,
    zb_h2,
    zbv,
)
from cutpipe.schedule.limits import MAX_OPS, estimated_ops
from cutpipe.schedule.params import CHUNKS, Param, parse_spec
from cutpipe.schedule.schedule import Schedule


def _one(ranks: int, **settings: int) -> int:
    return 1


@dataclass(frozen=True)
class ScheduleInfo:
    """A named generator, the facts a user picks it by, and the parameters it takes."""

    name: str
    base_title: str  # ``title`` adds the parameters that differ from their defaults
    generator: Callable[..., Schedule]  # (ranks, microbatches, **parameters) -> Schedule
    placement: str
    valid: str  # the valid (ranks, microbatches) range, in words
    #: the fewest microbatches, given the ranks and the parameters' values as keywords
    least_microbatches: Callable[..., int] = _one
    even_ranks: bool = False
    #: stages each rank holds (set from the parameter that says so, if there is one)
    stages_per_rank: int = 1
    kinds: int = 3  # ops per stage and microbatch at most: F, B and W (2 with a full backward)
    steps: Callable[[int], int] = _one  # microbatch steps the generator walks at least
    params: tuple[Param, ...] = ()
    aliases: tuple[str, ...] = ()  # other names, lower case without a "schedule" prefix
    values: tuple[tuple[str, int], ...] = ()  # parameters bound by ``bind``, in declared order
    #: what pictures call it, where a table's short title would not say enough
    picture_title: str = ""

    def __post_init__(self) -> None:
        for param in self.params:
            if param.stages_per_rank:
                object.__setattr__(self, "stages_per_rank", self.settings[param.name])

    @property
    def settings(self) -> dict[str, int]:
        """Every parameter's value: the bound ones, the defaults for the rest."""
        return {p.name: p.default for p in self.params} | dict(self.values)

    @property
    def title(self) -> str:
        """``Interleaved 1F1B``, or ``Interleaved 1F1B (chunks=4)`` away from the defaults."""
        changed = self.spec.split(":")[1:]
        return f"{self.base_title} ({', '.join(changed)})" if changed else self.base_title

    @property
    def display_title(self) -> str:
        """``title`` as pictures show it: ``Cut-in-half (DualPipeV)`` for ``dualpipev``."""
        if not self.picture_title:
            return self.title
        return self.title.replace(self.base_title, self.picture_title, 1)

    @property
    def spec(self) -> str:
        """The text that names this choice: ``interleaved:chunks=4`` (defaults left out)."""
        settings = self.settings
        changed = [
            f"{p.name}={settings[p.name]}" for p in self.params if settings[p.name] != p.default
        ]
        return ":".join([self.name, *changed])

    def param(self, key: str) -> Param:
        """The parameter called ``key``; an error lists the ones this schedule takes."""
        for param in self.params:
            if param.name == key:
                return param
        if not self.params:
            raise ValueError(f"{self.name} takes no parameters, got {key!r}")
        takes = "; ".join(p.describe() for p in self.params)
        raise ValueError(f"{self.name} takes no parameter {key!r}; it takes {takes}")

    def bind(self, **params: int) -> ScheduleInfo:
        """This entry with ``params`` set (each checked against its declared range)."""
        if not params:
            return self
        values = dict(self.values)
        for key, value in params.items():
            values[key] = self.param(key).check(self.name, value)
        ordered = tuple((p.name, values[p.name]) for p in self.params if p.name in values)
        return replace(self, values=ordered)

    def generate(self, num_ranks: int, num_microbatches: int, **params: int) -> Schedule:
        """The schedule for that many ranks and microbatches, with these parameters.

        Its name is ``spec``, so pictures and tables tell ``interleaved:chunks=4`` apart.
        """
        info = self.bind(**params)
        schedule = info.generator(num_ranks, num_microbatches, **info.settings)
        return schedule if schedule.name == info.spec else replace(schedule, name=info.spec)

    def min_microbatches(self, num_ranks: int, **params: int) -> int:
        """The fewest microbatches ``generate`` accepts on ``num_ranks`` ranks."""
        info = self.bind(**params)
        return info.least_microbatches(num_ranks, **info.settings)

    def accepts(self, num_ranks: int, num_microbatches: int, **params: int) -> bool:
        """Whether ``generate`` builds this schedule for that many ranks and microbatches."""
        info = self.bind(**params)
        if num_ranks < 1 or (info.even_ranks and num_ranks % 2):
            return False
        if info.ops_bound(num_ranks, num_microbatches) > MAX_OPS:
            return False
        return num_microbatches >= info.min_microbatches(num_ranks)

    def ops_bound(self, num_ranks: int, num_microbatches: int, **params: int) -> int:
        """At most how many ops the schedule holds (what ``MAX_OPS`` is checked against)."""
        info = self.bind(**params)
        return estimated_ops(
            num_ranks * info.stages_per_rank, num_microbatches, info.kinds, info.steps(num_ranks)
        )


ANY = "ranks >= 1, microbatches >= 1"
CHUNKED = "ranks >= 1, microbatches >= 1, chunks >= 1"

SCHEDULES: dict[str, ScheduleInfo] = {
    info.name: info
    for info in (
        ScheduleInfo("gpipe", "GPipe", gpipe, "linear", ANY, kinds=2),
        ScheduleInfo("1f1b", "1F1B", one_f_one_b, "linear", ANY, kinds=2),
        ScheduleInfo(
            "interleaved",
            "Interleaved 1F1B",
            interleaved,
            "interleaved",
            CHUNKED,
            kinds=2,
            params=(CHUNKS,),
            aliases=("interleaved1f1b",),
        ),
        ScheduleInfo(
            "loopedbfs",
            "Looped BFS",
            looped_bfs,
            "interleaved",
            CHUNKED,
            kinds=2,
            params=(CHUNKS,),
        ),
        ScheduleInfo(
            "interleavedzb",
            "Interleaved ZB",
            interleaved_zb,
            "interleaved",
            CHUNKED,
            params=(CHUNKS,),
            aliases=("interleavedzerobubble",),
        ),
        ScheduleInfo("zbh1", "ZB-H1", zb_h1, "linear", ANY),
        ScheduleInfo("zbh2", "ZB-H2", zb_h2, "linear", ANY),
        ScheduleInfo(
            "zbv",
            "ZB-V",
            zbv,
            "v",
            ANY,
            stages_per_rank=2,
            steps=lambda r: 2 * r - 1,
            aliases=("zbvzerobubble",),
        ),
        ScheduleInfo(
            "dualpipe",
            "DualPipe",
            dualpipe,
            "bidirectional",
            "even ranks >= 2, microbatches >= 2R-2 (odd counts: >= 2R-3), and >= 2",
            least_microbatches=lambda r: max(2, 2 * r - 3),
            even_ranks=True,
        ),
        ScheduleInfo(
            "dualpipev",
            "Cut-in-half",
            dualpipev,
            "v",
            "ranks >= 1, microbatches >= 2R-1",
            least_microbatches=lambda r: 2 * r - 1,
            stages_per_rank=2,
            picture_title="Cut-in-half (DualPipeV)",
        ),
    )
}

#: Every accepted spelling, folded (see ``_fold``), to its registry name.
_NAMES = {alias: info.name for info in SCHEDULES.values() for alias in (info.name, *info.aliases)}


def _fold(name: str) -> str:
    """Case and PyTorch's ``Schedule`` class-name prefix do not matter."""
    folded = name.strip().lower()
    return folded.removeprefix("schedule") or folded


def schedule_info(name: str, **params: int) -> ScheduleInfo:
    """Look a schedule up by name or alias, with parameters in the name or as keywords.

    ``schedule_info("interleaved:chunks=4")`` and ``schedule_info("Interleaved1F1B", chunks=4)``
    are the same entry. Unknown names list the known ones; a parameter given both ways, or
    unknown to the schedule, or out of its range, is a ValueError that says what to change.
    """
    if not isinstance(name, str):
        raise TypeError(
            f"the schedule name must be a str (one of {', '.join(SCHEDULES)}), got {name!r}"
        )
    base, texts = parse_spec(name)
    try:
        info = SCHEDULES[_NAMES[_fold(base)]]
    except KeyError:
        raise ValueError(
            f"unknown schedule {base!r}; known schedules: {', '.join(SCHEDULES)} "
            "(PyTorch's class names work too, e.g. ZBVZeroBubble)"
        ) from None
    twice = sorted(set(texts) & set(params))
    if twice:
        raise ValueError(f"{info.name}: {twice[0]} is given in the name and as a keyword")
    parsed = {key: info.param(key).parse(info.name, text) for key, text in texts.items()}
    return info.bind(**parsed, **params)


def generate(name: str, num_ranks: int, num_microbatches: int, **params: int) -> Schedule:
    """Build the named schedule for ``num_ranks`` ranks and ``num_microbatches`` microbatches.

    ``params`` are the schedule's keyword parameters (``chunks=4``), which may also be written
    in the name (``"interleaved:chunks=4"``). Refuses schedules of more than
    ``cutpipe.schedule.limits.MAX_OPS`` ops before building them.
    """
    return schedule_info(name, **params).generate(num_ranks, num_microbatches)
