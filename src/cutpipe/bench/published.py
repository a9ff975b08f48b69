"""The Cut-in-half report's measured figures, and cutpipe's beside them.

Source: Sea AI Lab's "Cut-in-half" analysis of DualPipe (2025,
huggingface.co/blog/ufotalent/cut-in-half; docs/formulas.md, "The Cut-in-half report"). Its
Table 2 measures 1F1B, DualPipe and Cut-in-half (DualPipeV) on 8 A100 GPUs training a 40-layer
MoE transformer with 8 experts, batch 1024, sequence length 2048: throughput in samples per
second, peak memory in GB, and the bubble and communication shares of the step. Its Table 1 gives
the structural comparison the measured figures are meant to show (``TABLE_1``), and its text
concludes that Cut-in-half needs close to 50 % less memory, communicates more, and is about 9 %
faster than DualPipe (``CONCLUSIONS``).

These are published figures to compare against, not to fit: ``compare`` sets each beside
cutpipe's simulation at the report's setting (``cutpipe.bench.simulated``) and the small real
run, and ``explain`` says, for each metric where the simulation and the report differ by more
than ``TOLERANCE``, whether the published figure fits cutpipe's model and why, from the
simulated step's own seconds and bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from cutpipe.bench.report import Row
from cutpipe.plan.costs.model import gpu, training_flops_per_token
from cutpipe.sim.formulas import bubble_1f1b, bubble_dualpipe

SOURCE = (
    'Sea AI Lab, "Cut-in-half" analysis of DualPipe (2025, '
    "huggingface.co/blog/ufotalent/cut-in-half), Table 2"
)

#: The experiment's setting as the report gives it (it does not give the pipeline x expert split
#: or the model's hidden sizes; ``SimulatedSetting``'s PP 4 x EP 2 and moe-40l's are cutpipe's).
REPORT_SETTING: dict[str, Any] = {
    "gpu": "A100",
    "devices": 8,
    "layers": 40,
    "experts": 8,
    "batch": 1024,
    "seq_len": 2048,
}

#: The schedules of Table 2, in its order.
SCHEDULES = ("1f1b", "dualpipe", "dualpipev")
#: Table 2's metrics, in the units of ``Row``: samples per second, bytes (the report's GB read
#: as 10^9 bytes), and shares of the step.
METRICS = ("throughput", "memory", "bubble", "comm")
LABELS = {
    "throughput": "throughput (samples/s)",
    "memory": "peak memory",
    "bubble": "bubble share",
    "comm": "communication share",
}

#: Table 2, as published. Read-only by convention: the tests check it against the report.
PUBLISHED: dict[str, dict[str, float]] = {
    "1f1b": {"throughput": 128.0, "memory": 48e9, "bubble": 0.22, "comm": 0.15},
    "dualpipe": {"throughput": 145.0, "memory": 52e9, "bubble": 0.18, "comm": 0.17},
    "dualpipev": {"throughput": 158.0, "memory": 28e9, "bubble": 0.15, "comm": 0.20},
}

#: Table 1 (d devices; its B is the full backward): bubble, parameters per device, pipeline and
#: expert-parallel traffic, against 1F1B's.
TABLE_1: dict[str, dict[str, Any]] = {
    "dualpipe": {"bubble": "(d/2-1)(F+B-3W)", "params_x": 2, "pp_traffic_x": 1, "ep_traffic_x": 1},
    "dualpipev": {
        "bubble": "((d-1)/2)(F+B-3W)",
        "params_x": 1,
        "pp_traffic_x": 2,
        "ep_traffic_x": 1,
    },
}

#: The report's conclusions from Table 2.
CONCLUSIONS = (
    "Cut-in-half needs close to 50% less memory than DualPipe",
    "Cut-in-half spends a larger share of the step communicating",
    "Cut-in-half's throughput is about 9% above DualPipe's",
)

#: How far the simulation may sit from the publication before the difference is explained:
#: throughput and peak memory as a ratio (within 10%: about what repeated runs of one schedule
#: vary by, and the report gives one run), the shares as a difference (within 3 points of the
#: step: the report rounds to whole percent, and cutpipe's bubble and communication are those of
#: the most idle and the most exposed rank, which can differ from an average by that much).
TOLERANCE = {"throughput": 0.10, "memory": 0.10, "bubble": 0.03, "comm": 0.03}
#: The metrics compared as a ratio; the others as a difference.
RATIOS = ("throughput", "memory")


def setting_differences(setting: Any) -> list[str]:
    """Where a ``SimulatedSetting`` departs from the report's (empty: it is the report's)."""
    from cutpipe.bench.simulated import default_model

    mine = {
        "gpu": setting.gpu.upper(),
        "devices": setting.devices,
        "layers": setting.model.layers,
        "experts": setting.model.experts,
        "batch": setting.batch,
        "seq_len": setting.model.seq_len,
    }
    differences = [
        f"{name} {mine[name]} (report: {value})"
        for name, value in REPORT_SETTING.items()
        if mine[name] != value
    ]
    if setting.model != default_model():
        differences.append(f"model {setting.model.name} (compared: moe-40l)")
    return differences


@dataclass(frozen=True)
class Comparison:
    """One metric of one schedule: the report's figure, the simulated one, the real run's."""

    metric: str
    schedule: str
    published: float
    simulated: float
    here: float | None  # the small real run, not to scale; None when it did not run
    versus: float  # simulated / published (``RATIOS``), else simulated - published
    agrees: bool  # within ``TOLERANCE``

    def to_dict(self) -> dict:
        return asdict(self)


def compare(simulated: Sequence[Row], measured: Sequence[Row] = ()) -> list[Comparison]:
    """Every metric of every schedule of Table 2 that the simulation has."""
    sim = {row.schedule: row for row in simulated}
    real = {row.schedule: row for row in measured}
    out = []
    for metric in METRICS:
        for name in SCHEDULES:
            if name not in sim:
                continue
            published = PUBLISHED[name][metric]
            value = getattr(sim[name], metric)
            if metric in RATIOS:
                versus = value / published
                agrees = abs(versus - 1) <= TOLERANCE[metric]
            else:
                versus = value - published
                agrees = abs(versus) <= TOLERANCE[metric]
            here = getattr(real[name], metric) if name in real else None
            out.append(Comparison(metric, name, published, value, here, versus, agrees))
    return out


@dataclass(frozen=True)
class Explanation:
    """Why the simulation and the report differ on one metric, from the simulated numbers."""

    metric: str
    consistent: bool  # whether the published figures fit cutpipe's model
    text: str

    def to_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        fits = "fits the model" if self.consistent else "does not fit the model"
        return f"- {LABELS[self.metric]}: the published figure {fits}. {self.text}"


def _gb(value: float) -> str:
    return f"{value / 1e9:.1f} GB"


def _pct(value: float) -> str:
    return f"{value:.1%}"


def _seq(values: Sequence[float], form: str) -> str:
    return "/".join(form.format(v) for v in values)


def _explain_throughput(sim: dict[str, Row], real: dict[str, Row], setting: Any) -> Explanation:
    one, dual, v = (sim[name] for name in SCHEDULES)
    d = v.detail
    ranks = d["ranks"]
    batch = v.throughput * d["makespan"]
    per_rank = sum(d["compute_per_rank"]) / ranks  # the same work for every schedule
    bound = batch / per_rank
    hardware = gpu(setting.gpu)
    at_peak = (
        ranks * hardware.peak() / (training_flops_per_token(setting.model) * setting.model.seq_len)
    )
    top = max(PUBLISHED[name]["throughput"] for name in SCHEDULES)
    pub = PUBLISHED
    pub_vd = pub["dualpipev"]["throughput"] / pub["dualpipe"]["throughput"]
    pub_v1 = pub["dualpipev"]["throughput"] / pub["1f1b"]["throughput"]
    sim_vd, sim_v1 = v.throughput / dual.throughput, v.throughput / one.throughput
    needed = dual.detail["makespan"] / pub_vd  # Cut-in-half's step at the published lead
    consistent = needed >= per_rank and top <= at_peak
    here = ""
    if all(name in real for name in ("1f1b", "dualpipe", "dualpipev")):
        here = (
            f", here {real['dualpipev'].throughput / real['dualpipe'].throughput:.2f}x and "
            f"{real['dualpipev'].throughput / real['1f1b'].throughput:.2f}x"
        )
    text = (
        f"Every schedule does the same {per_rank:.2f} s of compute per rank and step (sim.), so "
        f"none passes {bound:.1f} samples/s ({at_peak:.1f} even if every matmul ran at 100% of "
        f"{hardware.name} peak and nothing else took time); the published {top:.0f} needs a model with at most "
        f"{at_peak / top:.0%} of moe-40l's FLOPs per sample (the report gives no hidden sizes), "
        "so the absolute figures do not compare. Order: published Cut-in-half "
        f"{pub_vd:.2f}x DualPipe and {pub_v1:.2f}x 1F1B, sim. {sim_vd:.2f}x and {sim_v1:.2f}x"
        f"{here}. {pub_vd:.2f}x DualPipe's {dual.detail['makespan']:.2f} s step is a step of "
        f"{needed:.2f} s, "
        + (
            f"shorter than the {per_rank:.2f} s of compute a rank does on average: not possible "
            "for the same model on the same devices."
            if needed < per_rank
            else f"no shorter than the {per_rank:.2f} s of compute per rank: possible with less "
            "idle time than simulated."
        )
    )
    return Explanation("throughput", consistent, text)


def _explain_memory(sim: dict[str, Row], real: dict[str, Row], setting: Any) -> Explanation:
    one, dual, v = (sim[name] for name in SCHEDULES)
    pub = {name: PUBLISHED[name]["memory"] for name in SCHEDULES}

    def parts(row: Row) -> str:
        return (
            f"{_gb(row.memory)} = {_gb(row.memory_parts['state'])} state + "
            f"{_gb(row.memory_parts['activations'])} activations"
        )

    s1, a1 = one.memory_parts["state"], one.memory_parts["activations"]
    sd = dual.memory_parts["state"]
    sv, av = v.memory_parts["state"], v.memory_parts["activations"]
    room = pub["dualpipev"] - sv  # what a published-size peak leaves for activations
    below_pub = pub["dualpipev"] < pub["1f1b"]
    below_sim = v.memory < one.memory
    consistent = below_pub == below_sim
    if room > 0:
        needs = (
            f"a {_gb(pub['dualpipev'])} peak would leave {_gb(room)} for activations at this "
            f"state, {room / av:.2f}x the simulated {_gb(av)} "
            f"({room / v.detail['stage_activation']:.1f} of a "
            f"{_gb(v.detail['stage_activation'])} stage-microbatch)"
        )
    else:
        needs = (
            f"a {_gb(pub['dualpipev'])} peak is below this state alone, so the report's model "
            "must be smaller"
        )
    here = ""
    if all(name in real for name in SCHEDULES):
        here = (
            f"; here Cut-in-half/1F1B {real['dualpipev'].memory / real['1f1b'].memory:.2f}x "
            f"and /DualPipe {real['dualpipev'].memory / real['dualpipe'].memory:.2f}x (the "
            "small model)"
        )
    text = (
        f"Sim.: 1F1B {parts(one)}; DualPipe {parts(dual)}; Cut-in-half {parts(v)}. Cut-in-half "
        f"stores the parameters once like 1F1B ({sv / s1:.2f}x its state) and keeps "
        f"{av / a1:.2f}x its activations (PP+1 half-stage microbatches against R whole ones), "
        f"so its peak is {v.memory / one.memory:.2f}x 1F1B's"
        + (
            f"; published {pub['dualpipev'] / pub['1f1b']:.2f}x ({_gb(pub['dualpipev'])} vs "
            f"{_gb(pub['1f1b'])}) would need something else to differ: {needs}."
            if below_pub and not below_sim
            else f", published {pub['dualpipev'] / pub['1f1b']:.2f}x."
        )
        + f" DualPipe - 1F1B: published {_gb(pub['dualpipe'] - pub['1f1b'])}, sim. "
        f"{_gb(dual.memory - one.memory)} ({_gb(sd - s1)} of it the second copy of the state). "
        f"Cut-in-half/DualPipe: published {pub['dualpipev'] / pub['dualpipe']:.2f}x, sim. "
        f"{v.memory / dual.memory:.2f}x (near 0.5 only where the state outweighs the activations)"
        f"{here}."
    )
    return Explanation("memory", consistent, text)


def _explain_bubble(sim: dict[str, Row], real: dict[str, Row], setting: Any) -> Explanation:
    one, dual, v = (sim[name] for name in SCHEDULES)
    d1 = one.detail
    ranks, m = d1["ranks"], d1["microbatches"]
    work = d1["f"] + d1["b"] + d1["w"]  # one stage, one microbatch

    def pair(row: Row) -> float:
        dd = row.detail
        return dd["f"] + dd["b"] + dd["w"]  # F&B: the pair's compute, the all-to-all hidden

    forms = {
        "1f1b": bubble_1f1b(ranks, d1["f"], d1["b"], d1["w"]),
        "dualpipe": bubble_dualpipe(
            ranks, dual.detail["f"], dual.detail["b"], dual.detail["w"], pair(dual)
        ),
        "dualpipev": bubble_dualpipe(
            v.detail["stages"], v.detail["f"], v.detail["b"], v.detail["w"], pair(v)
        ),
    }
    shares = [forms[n] / sim[n].detail["makespan"] for n in SCHEDULES]
    uneven = [
        (max(sim[n].detail["compute_per_rank"]) - min(sim[n].detail["compute_per_rank"]))
        / sim[n].detail["makespan"]
        for n in SCHEDULES
    ]
    pub = [PUBLISHED[n]["bubble"] for n in SCHEDULES]
    # the microbatches per pipeline at which 1F1B's form gives the published share
    m_pub = (ranks - 1) * (1 / pub[0] - 1)
    at_pub = [forms[n] / (m_pub * work + forms[n]) for n in SCHEDULES]
    consistent = (forms["dualpipev"] < forms["dualpipe"]) == (pub[2] < pub[1])
    devices = setting.devices
    whole = (  # the same in device shares with every device in one pipeline
        f"; on all {devices} devices in one pipeline {(devices - 1) / 2 / (devices / 2 - 1):.2f}x"
        if devices > 2 and devices != ranks
        else ""
    )
    text = (
        f"Table 1's forms with the simulated F, B, W of a stage ({d1['f'] * 1e3:.1f}, "
        f"{d1['b'] * 1e3:.1f}, {d1['w'] * 1e3:.1f} ms; a V's half stage half that) and F&B = "
        f"F+B+W, on R = {ranks}: 1F1B (R-1)(F+B+W) = {forms['1f1b'] * 1e3:.0f} ms, DualPipe "
        f"(R/2-1)(F&B+B+W-3W) = {forms['dualpipe'] * 1e3:.0f} ms, Cut-in-half ((R-1)/2 shares) "
        f"{forms['dualpipev'] * 1e3:.0f} ms: {_seq(shares, '{:.1%}')} of the simulated steps of "
        f"{m} microbatches. The simulated {_seq([sim[n].bubble for n in SCHEDULES], '{:.1%}')} "
        f"is mostly uneven ranks ({_seq(uneven, '{:.1%}')} of the step between the busiest and "
        f"the least busy: the embedding and the head). The published {pub[0]:.0%} for 1F1B needs "
        f"m = {m_pub:.1f} microbatches on {ranks} ranks, where the forms give DualPipe "
        f"{at_pub[1]:.1%} and Cut-in-half {at_pub[2]:.1%} (published {pub[1]:.0%} and "
        f"{pub[2]:.0%}). The forms put Cut-in-half at "
        f"{forms['dualpipev'] / forms['dualpipe']:.2f}x DualPipe's bubble (half a device share "
        f"more{whole}), the report at {pub[2] / pub[1]:.2f}x"
        + (
            "."
            if consistent
            else ": its order is the opposite of Table 1's forms in device shares "
            "(docs/formulas.md)."
        )
    )
    return Explanation("bubble", consistent, text)


def _explain_comm(sim: dict[str, Row], real: dict[str, Row], setting: Any) -> Explanation:
    one, _, v = (sim[name] for name in SCHEDULES)
    hardware = gpu(setting.gpu)
    within = setting.devices <= hardware.gpus_per_node
    bandwidth, _ = hardware.link(within)

    def total(row: Row) -> float:
        d = row.detail
        return (max(d["alltoall_per_rank"]) + d["p2p_per_rank"]) / d["makespan"]

    totals = [total(sim[n]) for n in SCHEDULES]
    pub = [PUBLISHED[n]["comm"] for n in SCHEDULES]
    factor = pub[0] / totals[0]
    p2p_1 = one.detail["p2p_per_rank"] / one.detail["makespan"]
    p2p_v = v.detail["p2p_per_rank"] / v.detail["makespan"]
    rise_pub, rise_sim = pub[2] - pub[0], totals[2] - totals[0]
    consistent = all(
        abs(p - s) <= TOLERANCE["comm"] for p, s in ((pub[0], totals[0]), (rise_pub, rise_sim))
    )
    text = (
        "cutpipe's figure is the all-to-all time nothing hides "
        f"({_seq([sim[n].comm for n in SCHEDULES], '{:.1%}')}); all communication, hidden or "
        f"not (1F1B: {max(one.detail['alltoall_per_rank']):.2f} s of all-to-all and "
        f"{one.detail['p2p_per_rank']:.3f} s of point-to-point per rank and step), is "
        f"{_seq(totals, '{:.1%}')} of the step. The published {pub[0]:.0%} for 1F1B is "
        f"{factor:.1f}x that: links of about {bandwidth / factor / 1e9:.0f} GB/s instead of the "
        f"{bandwidth / 1e9:.0f} GB/s modelled for {hardware.name} "
        f"{'NVLink' if within else 'network'}. Twice the pipeline traffic takes point-to-point "
        f"from {p2p_1:.2%} to {p2p_v:.2%} of the step: Cut-in-half "
        f"{rise_sim * 100:+.2f} points over 1F1B in the model, published {rise_pub * 100:+.0f}"
        + (
            "; the rise fits, its size does not."
            if rise_sim > 0 and rise_pub > 0 and not consistent
            else "."
        )
    )
    return Explanation("comm", consistent, text)


EXPLAINERS = {
    "throughput": _explain_throughput,
    "memory": _explain_memory,
    "bubble": _explain_bubble,
    "comm": _explain_comm,
}


def explain(
    comparisons: Sequence[Comparison],
    simulated: Sequence[Row],
    measured: Sequence[Row] = (),
    setting: Any = None,
) -> list[Explanation]:
    """One explanation per metric on which some schedule's simulated figure is outside
    ``TOLERANCE`` of the published one, from the simulated rows' seconds and bytes.

    ``setting`` is the ``SimulatedSetting`` the rows come from (default: the report's).
    """
    from cutpipe.bench.simulated import SimulatedSetting

    setting = setting or SimulatedSetting()
    sim = {row.schedule: row for row in simulated}
    real = {row.schedule: row for row in measured}
    if not all(name in sim and sim[name].detail for name in SCHEDULES):
        return []
    off = dict.fromkeys(c.metric for c in comparisons if not c.agrees)
    return [EXPLAINERS[metric](sim, real, setting) for metric in off]


def tolerance_text() -> str:
    """``TOLERANCE`` in words."""
    return ", ".join(
        f"{LABELS[m]} within {TOLERANCE[m]:.0%}"
        if m in RATIOS
        else f"{LABELS[m]} within {TOLERANCE[m] * 100:.0f} points"
        for m in METRICS
    )


def render(comparisons: Sequence[Comparison], title: str) -> object:
    """A rich Table: per metric and schedule, published, simulated, the ratio or difference,
    and the small real run."""
    from rich.table import Table

    from cutpipe.schedule.registry import schedule_info

    table = Table(title=title)
    for header in ("metric", "method", "published", "sim.", "sim. vs pub.", "here"):
        table.add_column(header, justify="left" if header in ("metric", "method") else "right")

    def show(metric: str, value: float | None) -> str:
        if value is None:
            return "-"
        if metric == "throughput":
            return f"{value:.1f}"
        if metric == "memory":
            return _gb(value) if value >= 1e8 else f"{value / 1e6:.1f} MB"
        return _pct(value)

    previous = None
    for c in comparisons:
        if previous is not None and c.metric != previous:
            table.add_section()
        versus = f"{c.versus:.2f}x" if c.metric in RATIOS else f"{c.versus * 100:+.1f} pts"
        table.add_row(
            LABELS[c.metric] if c.metric != previous else "",
            schedule_info(c.schedule).title,
            show(c.metric, c.published),
            show(c.metric, c.simulated),
            versus + ("" if c.agrees else " *"),
            show(c.metric, c.here),
        )
        previous = c.metric
    return table
