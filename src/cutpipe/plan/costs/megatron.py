"""The planner against Megatron-LM's published large dense runs (docs/plan.md, "Calibration on
Megatron-LM's runs").

Two papers trained GPT models (a plain 4h MLP, no flash attention, sequences of 2,048, vocabulary
51,200, fp16) with Megatron-LM on Selene, DGX A100-80GB nodes of 8 GPUs with one 200 Gb/s HDR
NIC per GPU, tensor parallelism inside a node and pipelines across nodes:

- Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM" (SC21), Table 1: weak scaling from 1.7 B to 1 T parameters, achieved teraFLOP/s
  per GPU counted with their equation 3, ``96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h))`` per
  iteration (full activation recomputation: four forward-sized passes), their percentage of the
  312 TFLOP/s peak and aggregate petaFLOP/s. The shapes, layouts and batches are those of
  Megatron-LM's own script for the table (``examples/sc21/run_table_1.sh``), which also gives
  what the paper leaves out: the microbatch sizes, the interleaved schedule's layers per virtual
  stage (5, 5, 3 and 1 on the 76 B, 145 B, 310 B and 530 B models: 3, 2, 2 and 3 chunks per
  rank), ``--recompute-method uniform`` (full recomputation) everywhere, and PyTorch's DDP
  (the gradient all-reduce overlapped with the backward) up to 18 B, Megatron's local DDP (the
  all-reduce after the last backward) beyond. The throughput figures are quoted as commonly
  cited; the script and the paper's abstract (163 TFLOP/s, 502 petaFLOP/s on 3,072 GPUs)
  confirm the ends, and the tests check each row's three figures against one another.
- Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (MLSys
  2023), Table 4: seconds per iteration of 22 B, 175 B, 530 B and 1 T models with full
  recomputation and with the paper's sequence parallelism and selective recomputation, on one
  pipeline (no data parallelism), and the MFU and HFU of the latter (also in Megatron-LM's
  README). The microbatch sizes (4, 1, 1, 1) and the interleaving (3 chunks on 175 B and 530 B,
  none on 22 B and 1 T) are those of the validation configurations of Calculon (Isaev et al.,
  SC23, ``validation/*.json``), which reproduces this table.

No distributed optimizer existed yet (ZeRO 0). Nothing is fitted here: every run is priced with
the A100-80GB preset and the constants the zero-bubble paper's tables fixed
(``cutpipe.plan.costs.calibration``), through ``evaluate`` with the published layout forced.
As for the zero-bubble runs, the runs are modelled as Megatron-LM ran them: its schedules wait
for each pipeline send after each pass (``send_waits``), and PyTorch's DDP hides the gradient
all-reduce in the backward where the script used it (``Run.overlapped_allreduce``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cutpipe.plan.costs.calibration import blocking_sends
from cutpipe.plan.costs.hardware import Hardware, gpu
from cutpipe.plan.costs.model import Training, p2p_time, score_traffic, w_memory
from cutpipe.plan.partition import groups, stage_costs
from cutpipe.plan.recommend.evaluate import evaluate, job_items, simulated_counts
from cutpipe.plan.recommend.job import Job, Layout
from cutpipe.plan.recommend.plans import Plan
from cutpipe.schedule.registry import schedule_info
from cutpipe.sim.costs import Costs
from cutpipe.sim.metrics import extrapolate, metrics
from cutpipe.sim.simulate import simulate
from cutpipe.spec import ModelSpec

A100 = gpu("A100-80GB")
VOCAB, SEQUENCE = 51200, 2048
NARAYANAN, KORTHIKANTI = "Narayanan 2021", "Korthikanti 2022"
TFLOPS, SECONDS = "TFLOP/s per GPU", "s per iteration"


def _gpt(name: str, layers: int, hidden: int, heads: int, microbatch: int) -> ModelSpec:
    return ModelSpec(name, layers, hidden, heads, 4 * hidden, VOCAB, SEQUENCE,
                     microbatch_size=microbatch, dtype="fp16", gated_mlp=False,
                     flash_attention=False, qkv_bias=True, o_bias=True, mlp_bias=True,
                     tie_embeddings=True, activation="gelu")  # fmt: skip


@dataclass(frozen=True)
class Run:
    """One published run: its model, layout and setting, and what was measured."""

    paper: str
    model: ModelSpec
    billions: float  # the published parameter count
    tp: int
    pp: int
    gpus: int
    batch: int  # sequences per iteration
    chunks: int  # model chunks per rank: > 1 is Megatron's interleaved schedule
    recompute: str  # full | selective
    sequence_parallel: bool
    overlapped_allreduce: bool  # PyTorch DDP hides the gradient all-reduce in the backward
    measured: float
    unit: str  # TFLOPS or SECONDS
    percent_of_peak: float = 0.0  # Narayanan: the published share of 312 TFLOP/s
    aggregate: float = 0.0  # Narayanan: the published petaFLOP/s over all GPUs
    mfu: float = 0.0  # Korthikanti, selective runs: model and hardware FLOPs utilisation (%)
    hfu: float = 0.0

    @property
    def label(self) -> str:
        """The model, and the setting where a paper measured two."""
        if self.paper == KORTHIKANTI:
            return f"{self.model.name} {self.recompute}"
        return self.model.name

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def microbatches(self) -> int:
        """Per pipeline and iteration."""
        return self.batch // (self.dp * self.model.microbatch_size)

    @property
    def schedule(self) -> str:
        return f"interleaved:chunks={self.chunks}" if self.chunks > 1 else "1f1b"

    def layout(self) -> Layout:
        return Layout(self.pp, self.dp, 1, self.schedule, self.microbatches, self.tp)

    def training(self) -> Training:
        return Training(recompute=self.recompute, tp=self.tp,
                        sequence_parallel=self.sequence_parallel)  # fmt: skip

    def job(self, hardware: Hardware = A100) -> Job:
        # each rank reduces its gradients after its last backward, in one collective (local
        # DDP; PyTorch's DDP hides it in the backward: ``Run.overlapped_allreduce``)
        return Job(self.model, hardware, self.gpus, self.batch, reduction_start="rank")

    def describe(self) -> str:
        """A table cell: ``TP8 PP35 DP9, mb 1 x 280, interleaved x3, full``."""
        schedule = f"interleaved x{self.chunks}" if self.chunks > 1 else "1F1B"
        setting = self.recompute + (" + SP" if self.sequence_parallel else "")
        return (f"TP{self.tp} PP{self.pp} DP{self.dp}, mb {self.model.microbatch_size} x "
                f"{self.microbatches}, {schedule}, {setting}")  # fmt: skip


def _narayanan(billions, heads, hidden, layers, tp, pp, gpus, batch, microbatch, chunks,
               tflops, percent, aggregate) -> Run:  # fmt: skip
    model = _gpt(f"{billions:g}B", layers, hidden, heads, microbatch)
    return Run(NARAYANAN, model, billions, tp, pp, gpus, batch, chunks, "full", False,
               pp == 1, tflops, TFLOPS, percent, aggregate)  # fmt: skip


#: Table 1, with the microbatch sizes and chunks of ``examples/sc21/run_table_1.sh``.
NARAYANAN_RUNS = (
    _narayanan(1.7, 24, 2304, 24, 1, 1, 32, 512, 16, 1, 137, 44, 4.4),
    _narayanan(3.6, 32, 3072, 30, 2, 1, 64, 512, 16, 1, 138, 44, 8.8),
    _narayanan(7.5, 32, 4096, 36, 4, 1, 128, 512, 16, 1, 142, 46, 18.2),
    _narayanan(18.4, 48, 6144, 40, 8, 1, 256, 1024, 8, 1, 135, 43, 34.6),
    _narayanan(39.1, 64, 8192, 48, 8, 2, 512, 1536, 4, 1, 138, 44, 70.8),
    _narayanan(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 2, 3, 140, 45, 143.8),
    _narayanan(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 2, 2, 148, 47, 227.1),
    _narayanan(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 1, 2, 155, 50, 297.4),
    _narayanan(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 1, 3, 163, 52, 410.2),
    _narayanan(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 1, 1, 163, 52, 502.0),
)  # fmt: skip


def _korthikanti(name, billions, heads, hidden, layers, pp, batch, microbatch, chunks, full,
                 selective, mfu, hfu) -> tuple[Run, Run]:  # fmt: skip
    model = _gpt(name, layers, hidden, heads, microbatch)
    gpus = 8 * pp
    base = Run(KORTHIKANTI, model, billions, 8, pp, gpus, batch, chunks, "full", False, False,
               full, SECONDS)  # fmt: skip
    ours = replace(base, recompute="selective", sequence_parallel=True, measured=selective,
                   mfu=mfu, hfu=hfu)  # fmt: skip
    return base, ours


#: Table 4 (TP 8, one pipeline), with Calculon's microbatch sizes and chunks.
KORTHIKANTI_RUNS = (
    *_korthikanti("22B", 22, 64, 6144, 48, 1, 4, 4, 1, 1.42, 1.10, 41.5, 43.7),
    *_korthikanti("175B", 175, 96, 12288, 96, 8, 64, 1, 3, 18.13, 13.75, 51.4, 52.8),
    *_korthikanti("530B", 530, 128, 20480, 105, 35, 280, 1, 3, 49.05, 37.83, 56.0, 57.0),
    *_korthikanti("1T", 1000, 160, 25600, 128, 64, 512, 1, 1, 94.42, 71.49, 56.3, 57.0),
)  # fmt: skip
RUNS = NARAYANAN_RUNS + KORTHIKANTI_RUNS


def paper_parameters(model: ModelSpec) -> float:
    """Narayanan et al.'s equation 2: ``12*l*h^2*(1 + 13/(12h) + (V + s)/(12*l*h))`` (tied
    embedding, learned positions, biases and norms)."""
    l, h, V, s = model.layers, model.hidden, model.vocab, model.seq_len
    return 12 * l * h**2 * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))


def counted_flops(run: Run, hardware: bool = True) -> float:
    """FLOPs of one iteration as the paper counted them. Narayanan: equation 3 (four passes,
    full recomputation). Korthikanti: model FLOPs ``72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h))``, or
    with ``hardware`` and selective recomputation the attention scores counted twice more,
    ``s/(3h)`` in place of ``s/(6h)`` (their HFU)."""
    m = run.model
    B, s, l, h, V = run.batch, m.seq_len, m.layers, m.hidden, m.vocab
    if run.paper == NARAYANAN:
        return 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))
    attention = s / (3 * h) if hardware and run.recompute == "selective" else s / (6 * h)
    return 72 * B * s * l * h**2 * (1 + attention + V / (12 * l * h))


def measured_step(run: Run) -> float:
    """Seconds per iteration, as published or from the published TFLOP/s."""
    if run.unit == SECONDS:
        return run.measured
    return counted_flops(run) / (run.measured * 1e12 * run.gpus)


@dataclass(frozen=True)
class Prediction:
    """A run through ``evaluate``, with what Megatron-LM's software did that ``evaluate``'s
    schedules do not (``predict``)."""

    run: Run
    plan: Plan
    send_waits: float  # seconds the blocking pipeline sends add (``send_waits``)
    hidden_allreduce: float  # seconds of gradient all-reduce PyTorch's DDP hides in the backward

    @property
    def step(self) -> float:
        """Seconds per iteration, the planner's."""
        return self.plan.step_time + self.send_waits - self.hidden_allreduce

    @property
    def value(self) -> float:
        """The planner's figure in the paper's unit (TFLOP/s counted the paper's way)."""
        if self.run.unit == SECONDS:
            return self.step
        return counted_flops(self.run) / (self.step * 1e12 * self.run.gpus)

    @property
    def ratio(self) -> float:
        """Predicted over published, in the paper's unit."""
        return self.value / self.run.measured

    @property
    def step_ratio(self) -> float:
        """Predicted over measured iteration time (< 1: the planner is too optimistic)."""
        return self.step / measured_step(self.run)


def pipeline_send(run: Run, hardware: Hardware = A100) -> float:
    """Seconds of one pipeline send, at the link ``evaluate`` charges the run's pipeline."""
    return p2p_time(run.model, hardware, run.job(hardware).within_node, run.training())


def send_waits(run: Run, plan: Plan, hardware: Hardware = A100) -> float:
    """What Megatron-LM's blocking sends add to ``evaluate``'s step, in seconds.

    Megatron's 1F1B and interleaved schedules wait for each send/receive pair after each pass
    (``calibration.blocking_sends``); ``evaluate`` posts its sends, which delay only the pass
    that receives. ``predict`` goes through ``evaluate`` as ``recommend`` does, so the
    difference is added to its step: the plan's stages simulated both ways, on the costs
    ``evaluate`` builds, extrapolated as it does for long steps. It is not ``2*v*m`` sends (two
    per microbatch and chunk): the posted sends already cost the step part of that, where a
    tight schedule waits for them.
    """
    if run.pp == 1:
        return 0.0
    model, info = run.model, schedule_info(run.schedule)
    items = job_items(run.job(hardware), 1, run.training())
    posted = stage_costs(items, plan.stage_sizes, pipeline_send(run, hardware), w_memory(model))
    blocking = blocking_sends(posted, run.pp * run.chunks)
    short, long = simulated_counts(info, run.pp, run.microbatches)

    def makespan(costs: Costs) -> float:
        result = metrics(simulate(info.generate(run.pp, short), costs), costs)
        if long is not None:
            longer = metrics(simulate(info.generate(run.pp, long), costs), costs)
            result = extrapolate(result, longer, run.microbatches)
        return result.makespan

    return makespan(blocking) - makespan(posted)


def predict(run: Run, hardware: Hardware = A100) -> Prediction:
    """The run through ``evaluate`` with its published layout and setting forced, then as
    Megatron-LM ran it: its sends blocking (``send_waits``) and, on the runs that used PyTorch's
    DDP, the gradient all-reduce hidden in the backward (``evaluate`` charges it after)."""
    plan = evaluate(run.job(hardware), run.layout(), run.training())
    if not isinstance(plan, Plan):
        raise ValueError(f"{run.paper} {run.label}: the planner refuses it: {plan.reason}")
    hidden = plan.breakdown["dp_reduction"] if run.overlapped_allreduce else 0.0
    return Prediction(run, plan, send_waits(run, plan, hardware), hidden)


#: The columns of ``breakdown``, each the ``Plan.breakdown`` parts it sums.
COLUMNS = {
    "compute": ("forward", "backward", "weight"),
    "recompute": ("recompute",),
    "tp": ("tp_collectives",),
    "sends": ("pipeline_sends",),
    "bubble": ("bubble", "waiting"),
    "dp reduction": ("dp_reduction",),
    "optimizer": ("optimizer",),
}


def breakdown(prediction: Prediction) -> dict[str, float]:
    """Where the predicted step goes on its busiest rank, in seconds (``COLUMNS`` of
    ``Plan.breakdown``): matmuls, elementwise work and per-pass overhead (``compute``), the
    forward ``recompute`` reruns, TP collectives, pipeline sends (the blocking waits included),
    the schedule's idle time, the exposed gradient all-reduce, the optimizer step."""
    parts = prediction.plan.breakdown
    unknown = {k for k, v in parts.items() if v > 1e-9} - {p for c in COLUMNS.values() for p in c}
    if unknown:
        raise ValueError(f"{prediction.run.label}: no column for {', '.join(sorted(unknown))}")
    columns = {name: sum(parts.get(p, 0.0) for p in names) for name, names in COLUMNS.items()}
    columns["sends"] += prediction.send_waits
    columns["dp reduction"] -= prediction.hidden_allreduce
    return columns


def score_seconds(prediction: Prediction) -> float:
    """The busiest rank's time in the softmax and dropout over the attention scores
    (``score_traffic``): each of its layers moves them in F, in B and in the recomputed F."""
    run, plan = prediction.run, prediction.plan
    model, hardware = run.model, A100
    info = schedule_info(run.schedule)
    placement = info.generate(run.pp, info.min_microbatches(run.pp)).placement
    parts = groups(job_items(run.job(), 1, run.training()), plan.stage_sizes)
    layers = sum(
        item.name.startswith("layer")
        for stage in placement.stages_of(plan.busiest_rank)
        for item in parts[stage]
    )
    forward, backward = score_traffic(model, model.tokens / run.tp)
    moved = 2 * forward + backward if run.recompute != "none" else forward + backward
    return run.microbatches * layers * moved / hardware.memory_bandwidth


#: The modelled effects ``without`` takes out, one at a time.
EFFECTS = ("send waits", "DDP overlap", "no SP", "NCCL share", "score traffic")


def without(prediction: Prediction, effect: str) -> float:
    """The predicted step (seconds) with one of ``EFFECTS`` taken out of the model:

    - ``send waits``: Megatron's sends posted as ``evaluate`` posts them;
    - ``DDP overlap``: the gradient all-reduce after the backward;
    - ``no SP``: the runs without sequence parallelism priced with it (norms, dropouts and
      residuals split over the TP ranks);
    - ``NCCL share``: TP collectives at the node fabric's full bandwidth;
    - ``score traffic``: the softmax and dropout over the scores free (``score_seconds``; the
      elementwise constant was refitted with them, so this is their share, not a refit).
    """
    run, step = prediction.run, prediction.step
    if effect == "send waits":
        return step - prediction.send_waits
    if effect == "DDP overlap":
        return step + prediction.hidden_allreduce
    if effect == "no SP":
        return predict(replace(run, sequence_parallel=True)).step if run.tp > 1 else step
    if effect == "NCCL share":
        return predict(run, replace(A100, collective_bandwidth_share=1.0)).step
    if effect == "score traffic":
        return step - score_seconds(prediction)
    raise ValueError(f"effect must be one of {', '.join(EFFECTS)}, got {effect!r}")
