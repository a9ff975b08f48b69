"""One table in the Cut-in-half report's layout (throughput, peak memory, bubble, communication),
and what it says.

Each schedule is a ``Row`` from a run on this machine and one from the simulation at the
report's scale (docs/formulas.md). ``verdicts`` checks the report's claims about Cut-in-half
against both, and says why each holds or, where it does not, why not (a CPU and gloo are not eight
GPUs and NVLink).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

#: The report's three schedules plus ZB-V (the best V-shape without overlapped pairs): the
#: schedules both halves of the benchmark run, and those the claims below name.
LINEUP = ("1f1b", "dualpipe", "dualpipev", "zbv")


@dataclass(frozen=True)
class Row:
    """One schedule's figures: measured on this machine or simulated at the report's scale."""

    schedule: str
    title: str
    throughput: float  # samples per second
    memory: float  # bytes: the peak of the rank with the largest
    bubble: float  # share of the step the most idle rank spends waiting outside its ops
    comm: float  # share of the step a rank spends waiting for all-to-alls (the most exposed)
    memory_parts: dict[str, float] = field(default_factory=dict)  # of that rank: state, acts
    memory_per_rank: list[float] = field(default_factory=list)  # bytes
    params_x: float = 1.0  # parameters per device against 1F1B
    pp_traffic_x: float = 1.0  # pipeline point-to-point bytes against 1F1B
    note: str = ""
    # simulated rows: the step's parts in seconds and bytes (``simulate_at_scale``), from which
    # ``cutpipe.bench.published`` explains where the report's figures differ
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _by_name(rows: Sequence[Row]) -> dict[str, Row]:
    return {row.schedule: row for row in rows}


def _gb(value: float) -> str:
    return f"{value / 1e9:.1f} GB" if value >= 1e8 else f"{value / 1e6:.1f} MB"


def render(measured: Sequence[Row], simulated: Sequence[Row], title: str) -> object:
    """A rich Table: per schedule, this machine's figure beside the simulated one."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("method")
    for header in ("throughput (samples/s)", "peak memory", "bubble", "comm."):
        table.add_column(f"{header}\nhere | sim.", justify="right")
    real, sim = _by_name(measured), _by_name(simulated)
    for name in dict.fromkeys([*real, *sim]):
        a, b = real.get(name), sim.get(name)
        row = a or b
        assert row is not None
        table.add_row(
            row.title,
            f"{_num(a, 'throughput', '{:.1f}')} | {_num(b, 'throughput', '{:.1f}')}",
            f"{_mem(a)} | {_mem(b)}",
            f"{_num(a, 'bubble', '{:.1%}')} | {_num(b, 'bubble', '{:.1%}')}",
            f"{_num(a, 'comm', '{:.1%}')} | {_num(b, 'comm', '{:.1%}')}",
        )
    return table


def _num(row: Row | None, name: str, form: str) -> str:
    return "-" if row is None else form.format(getattr(row, name))


def _mem(row: Row | None) -> str:
    return "-" if row is None else _gb(row.memory)


@dataclass(frozen=True)
class Verdict:
    """One claim, whether each set of figures agrees (None: no figures) and why it does or not."""

    claim: str
    here: bool | None
    simulated: bool | None
    why: str

    def text(self) -> str:
        def word(value: bool | None) -> str:
            return "n/a" if value is None else ("agrees" if value else "does not agree")

        return (
            f"- {self.claim}: here {word(self.here)}, simulated {word(self.simulated)}. {self.why}"
        )


@dataclass(frozen=True)
class Reasons:
    """Why a claim holds, and why it may not: on this machine, and in the simulation.

    Each is a tuple of sentences; where both sets of figures disagree, a sentence the two
    reasons share is said once.
    """

    holds: str
    fails_here: tuple[str, ...]
    fails_simulated: tuple[str, ...]

    def explain(self, here: bool | None, simulated: bool | None) -> str:
        if here is None and simulated is None:
            return (
                "No figures to check it on (a schedule it names did not run, or nothing to hide)."
            )
        sentences = [
            *(self.fails_here if here is False else ()),
            *(self.fails_simulated if simulated is False else ()),
        ]
        return " ".join(dict.fromkeys(sentences)) if sentences else self.holds


def _pair(rows: dict[str, Row], name: str, a: str, b: str, form: str) -> str:
    if a not in rows or b not in rows:
        return "-"
    show = _gb if form == "bytes" else form.format
    return f"{show(getattr(rows[a], name))} vs {show(getattr(rows[b], name))}"


def _params_once(rows: dict[str, Row]) -> bool:
    return rows["dualpipe"].params_x >= 1.9 * rows["dualpipev"].params_x


def _less_memory(rows: dict[str, Row]) -> bool:
    return rows["dualpipev"].memory < rows["dualpipe"].memory


def _same_bubble(rows: dict[str, Row]) -> bool:
    return abs(rows["dualpipev"].bubble - rows["dualpipe"].bubble) <= 0.05


def _twice_traffic(rows: dict[str, Row]) -> bool:
    return abs(rows["dualpipev"].pp_traffic_x - 2 * rows["1f1b"].pp_traffic_x) < 0.01


def _hides_comm(rows: dict[str, Row]) -> bool | None:
    waits = [rows[name].comm for name in ("dualpipev", "1f1b", "zbv")]
    if not any(waits):
        return None  # no all-to-all to hide (a dense model, or EP 1)
    return waits[0] < min(waits[1:])


def _as_fast(rows: dict[str, Row]) -> bool:
    return rows["dualpipev"].throughput >= 0.95 * rows["dualpipe"].throughput


def _beats_1f1b(rows: dict[str, Row]) -> bool:
    return rows["dualpipev"].throughput > rows["1f1b"].throughput


_DEFECT = "a defect in cutpipe's figures, not a finding."
_UNEVEN = (
    "The equality holds for equal stages, with DualPipe on twice the devices. On the same "
    "devices the V's first rank holds both the embedding and the head, so its stages cannot be "
    "even and that rank sets the pace; DualPipe's mirror pairs a first stage with a last one on "
    "every rank."
)
_NOISE = "Runs on a shared machine vary by 10-20% between invocations."

#: Each claim: its text, the figures it quotes (field, first, second, format), its test, and why.
CLAIMS = (
    (
        "Cut-in-half stores the parameters once, DualPipe twice",
        ("params_x", "dualpipev", "dualpipe", "{:.0f}x"),
        _params_once,
        Reasons(
            "Structural: DualPipe keeps every stage on two ranks, Cut-in-half on one.",
            (f"The placements store DualPipe's stages twice and Cut-in-half's once: {_DEFECT}",),
            (f"The placements store DualPipe's stages twice and Cut-in-half's once: {_DEFECT}",),
        ),
    ),
    (
        "Cut-in-half needs less memory per device than DualPipe",
        ("memory", "dualpipev", "dualpipe", "bytes"),
        _less_memory,
        Reasons(
            "DualPipe's second copy of parameters, gradients and optimizer state is most of the "
            "difference; the activations are close (PP+1 stage-microbatches on both).",
            (
                "The model run here is small, so the training state DualPipe stores twice is a "
                "small part of the peak, and the activations measured (the storages autograd "
                "saves, a lower bound) decide it.",
            ),
            (
                "The V's activation peak (its first rank holds the embedding and the head) "
                "exceeds DualPipe's by more than DualPipe's second copy of the training state: "
                "activations dominate at this model and batch.",
            ),
        ),
    ),
    (
        "Cut-in-half has DualPipe's bubble, within 5 points of the step",
        ("bubble", "dualpipev", "dualpipe", "{:.1%}"),
        _same_bubble,
        Reasons(
            "On R devices the closed forms (docs/formulas.md) give DualPipe R/2-1 and "
            "Cut-in-half (R-1)/2 device shares of F&B+B+W-3W, half a share apart, and these "
            "stages are even enough for that to show.",
            (
                _UNEVEN,
                "Here, bubbles also carry the runtime's per-op cost and several processes "
                "sharing each core.",
            ),
            (_UNEVEN,),
        ),
    ),
    (
        "Cut-in-half sends twice 1F1B's pipeline traffic",
        ("pp_traffic_x", "dualpipev", "1f1b", "{:.0f}x"),
        _twice_traffic,
        Reasons(
            "Structural: the V crosses every rank boundary twice.",
            (f"The V crosses every rank boundary twice by construction: {_DEFECT}",),
            (f"The V crosses every rank boundary twice by construction: {_DEFECT}",),
        ),
    ),
    (
        "Overlapped F&B pairs hide the all-to-all: Cut-in-half waits for it less than 1F1B "
        "and ZB-V",
        ("comm", "dualpipev", "1f1b", "{:.1%}"),
        _hides_comm,
        Reasons(
            "A pair runs one half's all-to-all while the other half computes; 1F1B and ZB-V "
            "wait for every one. The simulation assumes copy engines that move data while the "
            "GPU computes.",
            (
                "On gloo every transfer is CPU work by gloo's threads on the cores the compute "
                "needs, so only the waiting for the peer rank hides, not the copying; and a rank "
                "of one pipeline also waits out its EP peer's pipeline bubbles.",
            ),
            (
                "A pair hides its all-to-alls only up to the other half's compute, and the ops "
                "outside pairs (warm-up, cool-down) hide none: with all-to-alls this long against "
                "the layers' compute, what is left is no less than 1F1B's or ZB-V's wait.",
            ),
        ),
    ),
    (
        "Cut-in-half is about as fast as DualPipe, within 5%",
        ("throughput", "dualpipev", "dualpipe", "{:.1f}/s"),
        _as_fast,
        Reasons(
            "Same overlapped pairs; the V's uneven first rank and extra point-to-point hops cost "
            "a little.",
            (
                "The V's uneven first rank and twice the point-to-point hops cost more here, "
                "where every hop is CPU work.",
                _NOISE,
            ),
            (
                "The V's first rank, holding the embedding and the head, sets the pace and costs "
                "more than 5% at this scale.",
            ),
        ),
    ),
    (
        "Cut-in-half trains faster than 1F1B",
        ("throughput", "dualpipev", "1f1b", "{:.1f}/s"),
        _beats_1f1b,
        Reasons(
            "Its smaller bubble and hidden all-to-alls win.",
            (
                "On a CPU the phases' extra Python work and the contention for cores eat the "
                "gain of the smaller bubble.",
                _NOISE,
            ),
            (
                "1F1B's bubble is already small at this many microbatches and the all-to-all a "
                "small share of the step, so the V's extra hops and uneven first rank cost more "
                "than it saves.",
            ),
        ),
    ),
)


def verdicts(measured: Sequence[Row], simulated: Sequence[Row]) -> list[Verdict]:
    """The Cut-in-half report's claims (docs/formulas.md), checked on both sets of figures,
    each with the figures and the reason it holds or, where it does not, why not."""
    real, sim = _by_name(measured), _by_name(simulated)

    def check(rows: dict[str, Row], test: Callable[[dict[str, Row]], bool | None]) -> bool | None:
        try:
            return test(rows)
        except KeyError:  # a schedule the claim names did not run
            return None

    out = []
    for claim, (name, a, b, form), test, reasons in CLAIMS:
        figures = f"(here {_pair(real, name, a, b, form)}; sim. {_pair(sim, name, a, b, form)})"
        here, simulated_ = check(real, test), check(sim, test)
        out.append(
            Verdict(f"{claim} {figures}", here, simulated_, reasons.explain(here, simulated_))
        )
    return out
