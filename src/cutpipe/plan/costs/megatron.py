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
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cutpipe.plan.costs.hardware import Hardware, gpu
from cutpipe.plan.costs.model import (
    ELEMENTWISE_PER_KEPT_BYTE,
    Training,
    optimizer_time,
    p2p_time,
)
from cutpipe.plan.partition import groups
from cutpipe.plan.recommend.evaluate import evaluate, job_items, ring_allreduce
from cutpipe.plan.recommend.job import Job, Layout
from cutpipe.plan.recommend.plans import Plan
from cutpipe.schedule.registry import schedule_info
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
        return Job(self.model, hardware, self.gpus, self.batch)

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
    run: Run
    plan: Plan
    step: float  # seconds, the planner's

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


def predict(run: Run, hardware: Hardware = A100) -> Prediction:
    """The run through ``evaluate`` with its published layout and setting forced."""
    plan = evaluate(run.job(hardware), run.layout(), run.training())
    if not isinstance(plan, Plan):
        raise ValueError(f"{run.paper} {run.label}: the planner refuses it: {plan.reason}")
    return Prediction(run, plan, plan.step_time)


def breakdown(prediction: Prediction) -> dict[str, float]:
    """Where the predicted step goes on its busiest rank, in seconds: matmuls, elementwise work
    and per-pass overhead (``compute``), tensor-parallel collectives (``tp``), the gradient
    all-reduce and the optimizer step as ``evaluate`` charges them, and the rest (``bubble``:
    the schedule's idle time, waits for pipeline sends included)."""
    run, plan = prediction.run, prediction.plan
    m, sizes = run.microbatches, plan.stage_sizes
    silent = replace(A100, intra_bandwidth=1e30, intra_latency=0.0)  # TP collectives free
    info = schedule_info(run.schedule)
    placement = info.generate(run.pp, info.min_microbatches(run.pp)).placement
    parts, free = (
        groups(job_items(run.job(hardware), 1, run.training()), sizes)
        for hardware in (A100, silent)
    )

    def on_rank(parts: list, rank: int) -> float:
        return sum(
            i.forward + i.backward + i.weight for s in placement.stages_of(rank) for i in parts[s]
        )

    busiest = max(range(run.pp), key=lambda rank: on_rank(parts, rank))
    busy, untimed = m * on_rank(parts, busiest), m * on_rank(free, busiest)
    parameters = sum(i.parameters for s in placement.stages_of(busiest) for i in parts[s])
    link = A100.link(within_node=run.gpus <= A100.gpus_per_node)
    allreduce = ring_allreduce(parameters * run.model.element_bytes, run.dp, *link)
    optimizer = optimizer_time(parameters, A100)
    return {
        "compute": untimed,
        "tp": busy - untimed,
        "allreduce": allreduce,
        "optimizer": optimizer,
        "bubble": prediction.step - busy - allreduce - optimizer,
    }


#: NCCL's all-reduce bus bandwidth on a DGX A100 (NVSwitch), commonly measured at about 230 of
#: NVLink's 300 GB/s per direction: an assumption for ``what_ifs``, not a measurement here.
NCCL_BUS_BANDWIDTH = 230e9


def what_ifs(prediction: Prediction) -> dict[str, float]:
    """The predicted step (seconds) with one effect the planner leaves out added, each alone,
    then all together:

    - ``blocking sends``: Megatron waits for each pipeline send after each pass, two per
      microbatch and chunk on every rank (``calibration.blocking_sends``);
    - ``no SP``: without sequence parallelism every TP rank runs the norms, dropouts and
      residuals on the whole activation: Korthikanti et al.'s ``10sbh`` bytes of the layer's
      ``34sbh``, in each forward, backward and recomputed forward, at the planner's
      elementwise traffic per kept byte;
    - ``TP at NCCL``: the TP collectives at ``NCCL_BUS_BANDWIDTH``;
    - ``DDP overlap``: PyTorch's DDP hides the gradient all-reduce in the backward.
    """
    run, step = prediction.run, prediction.step
    parts = breakdown(prediction)
    m, model, t = run.microbatches, run.model, run.tp
    send = p2p_time(model, A100, within_node=run.gpus <= A100.gpus_per_node,
                    training=run.training())  # fmt: skip
    passes = 3 if run.recompute == "full" else 2
    replicated = 5 * model.element_bytes * model.tokens * model.hidden * (1 - 1 / t)
    changes = {
        "blocking sends": 2 * run.chunks * m * send if run.pp > 1 else 0.0,
        "no SP": 0.0 if run.sequence_parallel else (
            m * model.layers / run.pp * passes * ELEMENTWISE_PER_KEPT_BYTE * replicated
            / A100.memory_bandwidth
        ),
        "TP at NCCL": parts["tp"] * (A100.intra_bandwidth / NCCL_BUS_BANDWIDTH - 1),
        "DDP overlap": -parts["allreduce"] if run.overlapped_allreduce else 0.0,
    }  # fmt: skip
    return {**{name: step + change for name, change in changes.items()},
            "all": step + sum(changes.values())}  # fmt: skip
