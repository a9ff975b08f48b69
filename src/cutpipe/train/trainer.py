"""One worker of a training run: model, data, optimizer, checkpoints, metrics, one step at a time.

Every process of the pipeline runs ``train(options)``; the process group comes from the
environment that ``torchrun`` or the elastic agent sets (``cutpipe train --nproc N`` starts
one). What it trains (model, loss, batches) is the run's task (``cutpipe.train.tasks``), where
its stages go is its layout (``cutpipe.train.layout``: a plan file's, or the defaults), and
how they are parallelized is stated once (``cutpipe.train.parallelize``). Each rank builds the
whole model from the same seed, keeps only its stages, and takes the same batches from a
loader whose order depends only on ``--seed``, so a run is reproducible bitwise in fp32 and a
resumed run continues exactly where the checkpoint left it. With ``--emulate`` the ops sleep
for their costs instead (no model, no data). docs/training.md walks through a run.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from cutpipe.train.options import TrainOptions
from cutpipe.train.step_parts import PIPELINE, StepParts

if TYPE_CHECKING:
    from cutpipe.train.balance import Balance
    from cutpipe.train.evaluate import Evaluation, Evaluator


@dataclass
class StepRecord:
    """What one optimizer step did, as the metrics log writes it."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens_per_s: float  # a regression sample counts as one token
    step_time: float
    bubble: float | None
    peak_activation_bytes: int
    #: MoE models: the load-balancing loss per layer and microbatch, each layer's max/mean
    #: tokens per expert (by its name in the model), the choices a capacity dropped
    balance_loss: float | None = None
    expert_load: dict[str, float] | None = None
    dropped: int | None = None
    #: after an evaluation (``cutpipe.train.evaluate``): the held-out loss, its perplexity and
    #: the evaluation's seconds (not in ``step_time``); the log writes them only then
    val_loss: float | None = None
    val_ppl: float | None = None
    val_time: float | None = None
    #: the pipeline steps' milliseconds, and the rest of the step's by part
    #: (``cutpipe.train.step_parts``): data, loss, timeline, clip, optimizer, routing
    pipeline_ms: float | None = None
    outside_ms: dict[str, float] | None = None
    #: the last pipeline step replayed by the simulator with its own measured op durations
    #: (``cutpipe.sim.fit.replayed``): the step the schedule allows with those ops, against
    #: which the step's own time shows what the runtime and the work around it cost
    replay_ms: float | None = None

    def to_dict(self) -> dict[str, Any]:
        fields = dict(self.__dict__)
        if self.val_loss is None:
            for name in ("val_loss", "val_ppl", "val_time"):
                del fields[name]
        return fields


def init_distributed(backend: str) -> tuple[int, int, torch.device]:
    """The process group from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...)."""
    if not dist.is_initialized():
        missing = [
            k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
        ]
        if missing:
            raise RuntimeError(
                f"no process group and no torchrun environment ({', '.join(missing)} unset): "
                "start workers with `cutpipe train --nproc N` or `torchrun ... -m cutpipe train`"
            )
        store = _worker_store()
        if store is None:
            dist.init_process_group(backend)
        else:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            dist.init_process_group(backend, store=store, rank=rank, world_size=world)
        if "OMP_NUM_THREADS" not in os.environ:  # as torchrun does: share the cores, do not fight
            local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    # a process group that was there already came with its threads chosen (cutpipe.launch.local)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device(
            "cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
        )
        torch.cuda.set_device(device)
    return rank, world, device


def _worker_store() -> dist.Store | None:
    """The agent's store, under a prefix of its own for every restart of the workers.

    torch reuses the elastic agent's TCPStore across restarts without a prefix per attempt, so
    restarted gloo workers would read the dead workers' addresses from it and fail to connect.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None  # torch's own env:// set-up
    from datetime import timedelta

    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
        timeout=timedelta(minutes=10),
    )  # fmt: skip
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"cutpipe/attempt_{attempt}", store)


class Trainer:
    """The state of one worker's run, and the step that advances it."""

    def __init__(self, options: TrainOptions) -> None:
        from cutpipe.parallel.mesh import build_mesh
        from cutpipe.train.layout import run_layout, with_plan
        from cutpipe.train.tasks import task_for

        self.options = options = with_plan(options)
        self.rank, self.world, self.device = init_distributed(options.backend)
        self.task = task_for(options)
        self.layout = run_layout(options, self.world, self.task)
        self.balance = self._balance()  # None: the plan's or the nominal partition
        if self.balance is not None:
            self.layout = replace(self.layout, stage_sizes=self.balance.sizes)
        self.schedule = self.layout.schedule
        self.batch = self.layout.batch
        self.mesh = build_mesh(
            self.layout.pipeline_ranks, ep=options.ep, dp=options.dp, device_type=self.device.type
        )
        self._unchecked: StepRecord | None = None  # an overlapped step awaiting its verdict
        self._moe_names: list[str] | None = None  # the model's MoE layers, once gathered
        self.evaluator: Evaluator | None = None  # a validation set's
        self.validation: dict[str, float] | None = None  # the latest evaluation's, checkpointed
        self.step = 0  # optimizer steps done
        self.checkpoints = None
        if options.emulate:
            self._emulate()
            return
        self._build()
        self.loader = self.task.loader(self.batch, options.seed)
        from cutpipe.train.evaluate import Evaluator

        self.evaluator = Evaluator.of_run(options, self.task, self.batch)
        if options.checkpoint_dir:
            from cutpipe.train.checkpoint import Checkpointer

            self.checkpoints = Checkpointer(  # rank 0 says what it did with the directory
                options.checkpoint_dir, keep=options.keep, say=functools.partial(print, flush=True)
            )

    def _balance(self) -> Balance | None:
        """Stages balanced from costs measured on this machine (``cutpipe.train.balance``).
        None where the partition is fixed (a plan, ``--balance nominal``) or there is no model
        to time (emulation, the example MLP)."""
        from cutpipe.train import balance
        from cutpipe.train.tasks import LanguageModelTask

        options, task = self.options, self.task
        if (
            options.emulate or options.plan or options.balance != "measured"
            or not isinstance(task, LanguageModelTask)
        ):  # fmt: skip
            return None
        layout = self.layout
        microbatch = layout.batch // (layout.schedule.num_microbatches * layout.replicas)
        return balance.agreed_balance(
            balance.run_spec(task.spec, microbatch), layout.schedule, options, self.device,
            first=self.rank == 0, ep=options.ep,
        )  # fmt: skip

    def _build(self) -> None:
        """This rank's stages of the model, parallelized, their runner and optimizer."""
        from cutpipe.parallel.expert_parallel import expert_parameters, shard_experts
        from cutpipe.runtime import PipelineRunner
        from cutpipe.runtime.compute.saved import SavedMeter
        from cutpipe.runtime.stages import Stage, cut_module
        from cutpipe.runtime.transport.flat import local_shard
        from cutpipe.train.optim import build_optimizer, warmup_cosine
        from cutpipe.train.parallelize import parallelize

        options = self.options
        held = self.schedule.placement.stages_of(self.mesh.pp_rank)
        # this rank's blocks only, each with the values the whole model gives it (the rest of
        # the model stays on the meta device, never allocated)
        blocks = held_blocks(self.layout.stage_sizes, held)
        model = self.task.build(options.seed, blocks)
        for index in blocks:
            model[index].to(self.device)
        if options.ep > 1:  # this rank's experts only, each under its name in the whole model
            shard_experts(model, self.mesh.ep_group)
        # this rank's stages, under the unsplit model's names
        stages = cut_module(
            model, self.layout.stage_sizes, num_stages=self.schedule.num_stages,
            held=held, make_stage=self.task.stage_maker(overlap=not options.no_overlap),
        )  # fmt: skip
        if options.init_from:  # this rank's tensors only, memory-mapped
            from cutpipe.models.hf import load_hf_weights

            for stage in stages.values():
                load_hf_weights(stage, options.init_from, self.task.spec)
        held = {id(p) for stage in stages.values() for p in stage.parameters()}
        experts = [p for p in expert_parameters(model) if id(p) in held]
        self.parallel = parallelize(stages, options, self.mesh, self.task.recompute_unit(), experts)
        # the runner steps the optimizer when it must overlap or skip steps; then nothing may end
        # a step with a wait for every rank (a recorded timeline starts with a barrier)
        boundary = (
            {"clip_grad_norm": options.clip, "skip_nonfinite": options.skip_nonfinite,
             "step_boundary": options.step_boundary,
             "partitioned": self.parallel.partitioned}
            if options.runner_steps else {}
        )  # fmt: skip
        # activations, op by op (what a W keeps included): parameters are not activations
        held_parameters = [p for stage in self.parallel.stages.values() for p in stage.parameters()]
        self.meter = SavedMeter(exclude=[local_shard(p) for p in held_parameters])
        self.loss_fn = self.task.loss()
        self.runner = PipelineRunner(
            self.schedule, self.parallel.stages, self.loss_fn, group=self.mesh.pp_group,
            record_timeline=self.records_timelines, step_timeout=options.step_timeout,
            reducer=self.parallel.reducer, op_meter=self.meter, **boundary, **_guard_times(),
        )  # fmt: skip
        # what this rank holds, under the unsplit model's names: what its checkpoints save (with
        # fsdp the blocks hold DTensor shards, which DCP saves and loads as they are)
        self.held = Stage(model, [b for s in sorted(stages) for b in stages[s].block_names])
        del model  # this rank keeps only its stages
        self.optimizer = build_optimizer(
            self.runner.modules, lr=options.lr, weight_decay=options.weight_decay,
            betas=(0.9, 0.95), shard_over=self.mesh.dp_group if options.dp_mode == "zero1" else None,
        )  # fmt: skip
        self.scheduler = warmup_cosine(
            self.optimizer, options.warmup_steps, options.steps, options.min_lr_ratio
        )

    def _emulate(self) -> None:
        """A runner whose ops sleep for their costs: no model, no data, no optimizer. With
        ``--ep`` each stage is an MoE layer whose phases sleep and whose exchanges are real
        all-to-alls on the EP group, done no earlier than their cost: the overlap hook runs."""
        from cutpipe.runtime import PipelineRunner
        from cutpipe.sim import Costs

        options = self.options
        self.parallel = None
        self.optimizer = self.scheduler = None
        self._emulated_batch: torch.Tensor | None = None
        costs = options.costs or Costs()
        if options.ep == 1:
            self.runner = PipelineRunner(
                self.schedule, None, emulate=costs, time_unit=options.time_unit,
                record_timeline=True, step_timeout=options.step_timeout, group=self.mesh.pp_group,
                **_guard_times(),
            )  # fmt: skip
            return
        from cutpipe.parallel.emulated_moe import emulated_moe_stages

        stages = emulated_moe_stages(
            costs, self.schedule.num_stages, self.schedule.placement.stages_of(self.mesh.pp_rank),
            options.time_unit, self.mesh.ep_group, overlap=not options.no_overlap,
        )  # fmt: skip
        self.runner = PipelineRunner(
            self.schedule, stages, _squared_error, record_timeline=True,
            step_timeout=options.step_timeout, group=self.mesh.pp_group, **_guard_times(),
        )  # fmt: skip
        # a row per EP rank per microbatch, one for each peer: the sleeps set the time
        rows = self.schedule.num_microbatches * options.ep
        self._emulated_batch = torch.zeros(rows, 1, device=self.device)

    @property
    def records_timelines(self) -> bool:
        """Whether steps record their timeline: not when steps overlap (a recorded step starts
        with a barrier)."""
        return self.options.emulate or self.options.step_boundary == "sync"

    def describe(self) -> str:
        """One line: what runs where, and whose partition it is."""
        layout, options = self.layout, self.options
        where = (
            f"{layout.pipeline_ranks} ranks"
            + (f" x DP {layout.dp}" if layout.dp > 1 else "")
            + (f" x EP {layout.ep}" if layout.ep > 1 else "")
        )
        head = f"{self.schedule.name} on {where}, {self.schedule.num_microbatches} microbatches"
        if options.emulate:
            return f"{head}, emulated"
        sizes = ", ".join(map(str, layout.stage_sizes))
        if options.plan:
            source = f"from {options.plan}"
        elif self.balance is not None:
            source = f"balanced from {self.balance.source}; {self.balance.expected()}"
        else:
            source = "the planner's partition for an H100"
        return f"{self.task.name}: {head}, blocks per stage {sizes} ({source})"

    # -- checkpoints ------------------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        """What a checkpoint keeps besides the tensors: the step, the data's position, and the
        run's record that a resumed run is compared with (``cutpipe.train.resume``)."""
        from cutpipe.train.resume import run_record

        record = run_record(self.options, self.task, self.layout)
        state = {"step": self.step, "loader": self.loader.state_dict(), "run": record}
        if self.validation is not None:
            state["validation"] = self.validation
        return state

    def resume(self, restarted: bool = False) -> int | None:
        """Begin in the checkpoint directory as the options say (a new run is refused where
        checkpoints are; docs/training.md, "Checkpoints") and continue from its latest complete
        checkpoint when the run resumes, or the agent ``restarted`` this worker; the step it was
        taken after."""
        if self.checkpoints is None:
            return None
        from cutpipe.train.checkpoint import start_mode
        from cutpipe.train.resume import apply_schedule, differences, run_record

        checkpoints = self.options.checkpoints
        mode = start_mode(
            resume=checkpoints.resume, resume_if_present=checkpoints.resume_if_present,
            overwrite=checkpoints.overwrite,
        )  # fmt: skip
        restored = self.checkpoints.start(
            mode, self.held, self.optimizer, self.scheduler, fallback=checkpoints.resume_fallback,
            run=os.environ.get("TORCHELASTIC_RUN_ID"), restarted=restarted,
        )  # fmt: skip
        if restored is None:
            return None
        extra = restored.extra
        step = int(extra["step"])
        found = differences(extra.get("run"), run_record(self.options, self.task, self.layout))
        found.check(step)  # another run's checkpoint: refused before any step
        if found.reschedules:
            apply_schedule(self.optimizer, self.scheduler, self.options)
        said = found.line()
        if said and self.rank == 0:  # what the run changes is said even with --quiet
            print(said, flush=True)
        self.step = step
        self.loader.load_state_dict(extra["loader"])
        self.validation = extra.get("validation")
        return self.step

    def save(self) -> float:
        """Start an asynchronous checkpoint of the state after ``self.step`` (its verdict read
        first: ``settled()`` then gives its record); seconds blocked."""
        assert self.checkpoints is not None
        start = time.perf_counter()
        with self.runner.progress.watched("saving a checkpoint"):
            self.runner.settle()
            self.checkpoints.save(
                self.step, self.held, self.optimizer, self.scheduler, self._state()
            )
        return time.perf_counter() - start

    # -- validation -------------------------------------------------------------------------------

    def evaluate(self) -> Evaluation:
        """The held-out loss of the model as it is now (every rank calls it; ``Evaluation``);
        the latest is kept for checkpoints."""
        with self.runner.progress.watched("evaluating the held-out loss"):
            evaluation = self.evaluator.run(self)
        # the same on every rank (the time is not): what checkpoints keep
        self.validation = {
            "step": evaluation.step, "val_loss": evaluation.loss, "val_ppl": evaluation.perplexity
        }  # fmt: skip
        return evaluation

    # -- one step ---------------------------------------------------------------------------------

    def autocast(self) -> contextlib.AbstractContextManager:
        """The precision the run computes in: bf16 autocast, or as is (training and evaluation)."""
        if self.options.dtype == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def train_step(self) -> list[StepRecord]:
        """One optimizer step over ``grad_accum`` pipeline steps; the records of the steps whose
        verdict is now known (this one; with ``step_boundary="overlap"`` the one before)."""
        # the pipeline's own step is watched as a step; what surrounds it (the loss, the
        # gradient norm, the optimizer step, routing statistics) also waits on the peers
        with self.runner.progress.watched("the optimizer step"):
            if self.options.emulate:
                return [self._emulated_step()]
            if self.options.runner_steps:
                return self._runner_step()
            return [self._accumulated_step()]

    def settled(self) -> list[StepRecord]:
        """The record of an overlapped step still awaiting its verdict, once it has come (the
        runner's ``settle`` waits for it)."""
        if self._unchecked is None:
            return []
        self.runner.settle()
        return self._checked()

    def _checked(self) -> list[StepRecord]:
        """The pending record, completed with the verdict the runner has read on it."""
        record, self._unchecked = self._unchecked, None
        verdict = self.runner.verdict
        if record is None or verdict is None:
            return []
        loss = math.nan if verdict.loss is None else verdict.loss
        if self.mesh.replicas > 1:
            loss = float(self.mesh.average(torch.tensor(loss, device=self.device)))
        return [replace(record, loss=loss, grad_norm=verdict.norm)]

    def _batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next batch, on this rank's device, this replica's share of it."""
        inputs, targets = next(self.loader)
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        return self.mesh.shard(inputs), self.mesh.shard(targets)

    def _record(self, seconds: float, **fields: Any) -> StepRecord:
        """A step's record: throughput from its time, the rest as given."""
        samples = self.batch * self.options.grad_accum
        return StepRecord(
            step=self.step, step_time=seconds,
            tokens_per_s=samples * self.task.tokens_per_sample / seconds,
            peak_activation_bytes=self.meter.peak if self.parallel is not None else 0,
            **fields,
        )  # fmt: skip

    def _runner_step(self) -> list[StepRecord]:
        """One pipeline step whose optimizer step the runner takes, at its step boundary."""
        start = time.perf_counter()
        inputs, targets = self._batch()
        lr = self.optimizer.param_groups[0]["lr"]
        self.meter.reset()
        with self.autocast(), self.meter:
            self.runner.step(inputs, targets, optimizer=self.optimizer)
        self.scheduler.step()
        self.step += 1
        seconds = time.perf_counter() - start
        ready = self._checked() if self.options.step_boundary == "overlap" else []
        self._unchecked = self._record(
            seconds, loss=math.nan, lr=lr, grad_norm=math.nan, bubble=None, **self._routing()
        )
        if self.options.step_boundary == "sync":
            ready = self._checked()
        return ready

    def _accumulated_step(self) -> StepRecord:
        """One optimizer step over ``grad_accum`` pipeline steps, clipped here."""
        from cutpipe.runtime.clipping import clip_grad_norm, mirror_copies
        from cutpipe.sim import metrics
        from cutpipe.sim.fit import replayed
        from cutpipe.train.optim import accumulate

        options = self.options
        start = time.perf_counter()
        fsdp = self.parallel.fsdp
        parts = StepParts()

        def batches():
            for index in range(options.grad_accum):
                with parts.timed("data"):
                    batch = self._batch()
                self.parallel.reduce_next_step(index == options.grad_accum - 1)
                if fsdp is not None:
                    # all-gathered now rather than by the first forwards, so that the meter
                    # knows the unsharded parameters (new storage every step) are no activations
                    with parts.timed("fsdp_unshard"):
                        fsdp.unshard()
                    self.meter.also_exclude(self.runner.parameters())
                yield batch

        self.meter.reset()
        with self.autocast(), self.meter, parts.timed(PIPELINE):
            loss = accumulate(self.runner, batches())
        parts.add(PIPELINE, -sum(parts.ms.get(p, 0.0) for p in ("data", "fsdp_unshard")))
        # the step's accounting (routing, loss, timeline) starts now and is read after the
        # optimizer step: its collectives' waits hide behind the gradient norm and the update
        with parts.timed("routing"):
            finish_routing = self._start_routing()
        with parts.timed("loss"):
            finish_loss = self.mesh.start_average(loss)
        with parts.timed("timeline"):
            finish_timeline = self.runner.start_timeline()
        with parts.timed("clip"):
            norm = clip_grad_norm(  # clip=None: only measure
                self.runner.parameters(), math.inf if options.clip is None else options.clip,
                group=self.runner.group, copies=mirror_copies(self.schedule),
                partitioned=self.parallel.partitioned,
            )  # fmt: skip
        lr = self.optimizer.param_groups[0]["lr"]
        with parts.timed("optimizer"):
            self.optimizer.step()
            self.scheduler.step()
        self.step += 1
        with parts.timed("routing"):
            routing = finish_routing()
        with parts.timed("loss"):
            loss = float(finish_loss())
        with parts.timed("timeline"):
            timeline = finish_timeline()
            replay_ms = None if timeline is None else metrics(replayed(timeline)).makespan * 1e3
        seconds = time.perf_counter() - start
        return self._record(
            seconds, loss=loss, lr=lr, grad_norm=float(norm),
            bubble=None if timeline is None else metrics(timeline).bubble_ratio,
            pipeline_ms=parts.pipeline_ms, outside_ms=parts.outside(),
            replay_ms=None if replay_ms is None else round(replay_ms, 3), **routing,
        )  # fmt: skip

    def _routing(self) -> dict[str, Any]:
        """After an optimizer step of an MoE model: move the balancing bias (if asked), and what
        the step's routing did (``_start_routing``, read at once)."""
        return self._start_routing()()

    def _start_routing(self) -> Callable[[], dict[str, Any]]:
        """As a pipeline step ends, start summing what every MoE layer of the model routed
        (each rank holds some: summed over the whole run in one all-reduce, DualPipe's two
        copies of a layer added up); the returned function moves the balancing bias (if asked)
        and reads the sum, so that the all-reduce's wait hides behind the optimizer step."""
        if not self.task.is_moe:
            return dict
        from cutpipe.parallel.routing import (
            moe_layers_of,
            start_model_routing_statistics,
            update_routing_bias,
        )

        stages = self.parallel.stages
        if self._moe_names is None:  # once: the model's MoE layers, each rank naming its own
            every: list[Any] = [None] * self.layout.pipeline_ranks
            mine = sorted(moe_layers_of(stages))
            if self.layout.pipeline_ranks > 1:
                dist.all_gather_object(every, mine, group=self.mesh.pp_group)
            else:
                every = [mine]
            self._moe_names = sorted({name for names in every for name in names})
        read = start_model_routing_statistics(
            stages, self._moe_names, self.task.spec.experts, reset=True, device=self.device
        )

        def finish() -> dict[str, Any]:
            if self.options.routing_bias_rate > 0:
                update_routing_bias(
                    stages, self.options.routing_bias_rate, reduce=self.mesh.sum_over_replicas
                )
            merged = read().layers
            microbatches = sum(layer.microbatches for layer in merged.values())
            return {
                "balance_loss": sum(m.balance_loss for m in merged.values()) / max(microbatches, 1),
                "expert_load": {name: layer.imbalance for name, layer in merged.items()},
                "dropped": sum(layer.dropped for layer in merged.values()),
            }

        return finish

    def _emulated_step(self) -> StepRecord:
        """One pipeline step of sleeps: its time and its measured bubble."""
        from cutpipe.sim import metrics

        start = time.perf_counter()
        batch = self._emulated_batch
        self.runner.step(batch, batch)
        self.step += 1
        timeline = self.runner.timeline()
        return self._record(
            time.perf_counter() - start, loss=math.nan, lr=0.0, grad_norm=math.nan,
            bubble=None if timeline is None else metrics(timeline).bubble_ratio,
        )  # fmt: skip

    def close(self, failed: bool = False) -> None:
        """Finish the pending checkpoint and let go; after a failure, without waiting for
        ranks that may be gone."""
        if self.checkpoints is not None:
            if failed:
                self.checkpoints.abandon()
            else:
                self.checkpoints.close()
        if self.parallel is not None:
            self.parallel.close()
        self.runner.close()


def held_blocks(stage_sizes: Sequence[int], stages: Iterable[int]) -> list[int]:
    """The positions of the blocks of ``stages``, cut ``stage_sizes`` blocks per stage."""
    starts = [0, *itertools.accumulate(stage_sizes)]
    return [b for stage in sorted(set(stages)) for b in range(starts[stage], starts[stage + 1])]


def _squared_error(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The emulated MoE stages' loss: any scalar with a backward will do."""
    return (outputs - targets).pow(2).mean()


#: Tests only: "RANK:STEP" makes that rank die like a lost machine at that step, first attempt.
FAULT_VARIABLE = "CUTPIPE_FAULT_KILL"


#: Tests only: "DEAD:EXIT" sets the failure guard's ``dead_after`` and ``exit_after`` (seconds),
#: so that a test of a frozen worker waits seconds for the guard, not the defaults' half minute.
GUARD_VARIABLE = "CUTPIPE_GUARD_SECONDS"


def _guard_times() -> dict[str, float]:
    dead, _, leave = os.environ.get(GUARD_VARIABLE, "").partition(":")
    return {"dead_after": float(dead), "exit_after": float(leave)} if leave else {}


def _maybe_fault(rank: int, step: int) -> None:
    fault = os.environ.get(FAULT_VARIABLE)
    if not fault or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    where, _, when = fault.partition(":")
    if int(where) == rank and int(when) == step:
        os.kill(os.getpid(), signal.SIGKILL)


def train(options: TrainOptions) -> dict[str, Any]:
    """Run (or resume) the training run ``options`` describes; rank 0 reports as it goes."""
    from cutpipe.train.metrics import Profiler, ProgressLine
    from cutpipe.train.sinks import describe_run, open_sinks

    trainer = Trainer(options)
    rank = trainer.rank
    if rank == 0 and not options.quiet:
        print(trainer.describe(), flush=True)
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    resumed = trainer.resume(restarted)
    log = open_sinks(options, describe_run(trainer), resumed) if rank == 0 else None
    progress = ProgressLine(options, trainer, resumed) if rank == 0 and not options.quiet else None
    profiler = Profiler(options, rank, first_step=trainer.step + 1)
    records: list[StepRecord] = []
    stalls: list[float] = []
    evaluated: dict[int, dict[str, float]] = {}  # step: the fields its record gains
    failed = True
    try:
        while trainer.step < options.steps:
            _maybe_fault(rank, trainer.step + 1)
            ready = trainer.train_step()
            profiler.step()
            if trainer.evaluator is not None and trainer.evaluator.due(trainer.step):
                evaluated[trainer.step] = trainer.evaluate().fields()  # after the step's time
                ready += trainer.settled()  # the evaluation read the verdict on the step
            every = options.checkpoint_every
            if trainer.checkpoints is not None and (
                (every and trainer.step % every == 0) or trainer.step == options.steps
            ):
                stalls.append(trainer.save())  # it reads the verdict on the step it saves
                ready += trainer.settled()
            elif trainer.step == options.steps:
                ready += trainer.settled()
            for record in ready:
                if record.step in evaluated:
                    record = replace(record, **evaluated.pop(record.step))
                if not (math.isfinite(record.loss) or options.skip_nonfinite or options.emulate):
                    raise FloatingPointError(
                        f"the loss became {record.loss} at step {record.step}: lower --lr, use "
                        "--clip, or --skip-nonfinite to skip such steps"
                    )
                records.append(record)
                if log is not None:
                    log.write(record)
                if progress is not None:
                    progress.update(record)
        timeline = trainer.runner.timeline() if trainer.records_timelines else None
        failed = False
    finally:
        profiler.close()
        if progress is not None:
            progress.close()
        if log is not None:
            log.close()
        trainer.close(failed)
    if rank == 0 and options.trace and timeline is not None:
        timeline.save(options.trace)
    return {
        "rank": rank,
        "task": trainer.task.name,
        "loss_words": trainer.task.loss_words,
        "losses": [r.loss for r in records],
        "first_step": records[0].step if records else None,
        "resumed_from": resumed,
        "entropy": trainer.task.baseline(),
        "checkpoint_stall": stalls,
        "validation": trainer.validation,
        "records": [r.to_dict() for r in records],
        "timeline": None if timeline is None else timeline.to_dict(),
        "stage_sizes": list(trainer.layout.stage_sizes),
        "blocks": [] if trainer.parallel is None else list(trainer.held.block_names),
    }
