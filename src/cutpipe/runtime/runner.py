"""``PipelineRunner``: run any cutpipe schedule on torch.distributed, one pipeline rank per process.

Every rank builds a runner from the same schedule and its own stage modules, then calls ``step`` with
the batch: the rank holding the first stage reads the inputs, the one holding the last stage reads
the targets (passing both everywhere is fine). The step splits the batch into the schedule's
microbatches, runs this rank's ops in order, and leaves the gradients in the parameters:

- ``loss_reduction="mean"`` (default): the gradients of the mean of the microbatch losses, i.e.
  their sum divided by the microbatch count. With a loss that averages within a microbatch, this
  equals one ``loss_fn`` over the whole batch, as torch's own pipelining schedules do;
- ``loss_reduction="sum"``: of their sum.

Under ``torch.no_grad()`` a step runs the forwards only. DualPipe's two copies of each stage get
their gradients summed before ``step`` returns, so an optimizer sees one consistent model.

Everything that can be checked locally is checked before any communication: the schedule fits the
process group, the modules match this rank's stages, the batch splits into the microbatches.

The runner only walks the program: the executor runs each op and the transport moves its values
(``cutpipe.runtime.protocols``), the collectives it needs go through one small interface
(``cutpipe.runtime.transport.collectives``), and how it runs is one ``RunnerOptions`` value.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cutpipe.runtime.batch import batch_size, to_microbatches
from cutpipe.runtime.clipping import mirror_copies
from cutpipe.runtime.failure.agreement import (
    FAILED_FIELD,
    STEP_FIELDS,
    agree_on_setup,
    check_step,
    describe,
    failed_ranks,
    step_word,
)
from cutpipe.runtime.failure.guard import Guard, PipelineError
from cutpipe.runtime.failure.heartbeat import Progress
from cutpipe.runtime.options import RunnerOptions
from cutpipe.runtime.program import Instruction, Pair, RankProgram, halves
from cutpipe.runtime.protocols import (
    Executor,
    ExecutorContext,
    Transport,
    TransportContext,
    Value,
    default_executor,
    default_transport,
)
from cutpipe.runtime.stages import (
    Split,
    cut_module,
    named_parameters_of,
    sequence_blocks,
    state_dict_of,
)
from cutpipe.runtime.step_boundary import StepBoundary, Verdict
from cutpipe.runtime.transport.collectives import Alone, Collectives
from cutpipe.runtime.transport.mailbox import HEADER_LENGTH, PeerLost, encode_header, meta_of
from cutpipe.schedule.codes import B_CODE, BW_CODE, F_CODE, W_CODE
from cutpipe.schedule.schedule import Schedule
from cutpipe.sim.timeline import Timeline


def held_stages(schedule: Schedule, group: dist.ProcessGroup | None = None) -> tuple[int, ...]:
    """The stages this process holds in ``group`` (default: the world); none if the schedule
    has no such rank (the runner's constructor then says what does not fit)."""
    rank = dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0
    return schedule.placement.stages_of(rank) if 0 <= rank < schedule.num_ranks else ()


def _pipeline_group(
    schedule: Schedule, group: dist.ProcessGroup | None
) -> tuple[dist.ProcessGroup | None, int, int, list[int]]:
    """(group, this rank in it, its size, its ranks as global ranks)."""
    if dist.is_available() and dist.is_initialized():
        group = group or dist.group.WORLD
        world = dist.get_world_size(group)
        ranks = [dist.get_global_rank(group, r) for r in range(world)]
        return group, dist.get_rank(group), world, ranks
    if group is None and getattr(schedule, "num_ranks", None) == 1:
        return None, 0, 1, [0]
    raise ValueError(
        "torch.distributed is not initialized: start one process per rank (torchrun, or "
        "cutpipe.launch.local) and call torch.distributed.init_process_group first"
    )


class PipelineRunner:
    """Executes this rank's part of a schedule, step after step.

    ``options`` (a ``RunnerOptions``), or any of its fields as keywords, say how: loss reduction,
    B/W split, emulation, timelines, the failure model's timeouts, the executor and transport.
    """

    def __init__(
        self,
        schedule: Schedule,
        stages: Mapping[int, nn.Module] | None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        options: RunnerOptions | None = None,
        **overrides: Any,
    ) -> None:
        self.schedule = schedule
        self._closed = False
        self.group, self.rank, self.world_size, self._global = _pipeline_group(schedule, group)
        self.progress = Progress()
        self._position = -1
        self._guard: Guard | None = None
        self._transport: Transport | None = None
        self._collectives: Collectives | Alone = Alone()
        store = self._store() if self.world_size > 1 else None
        # every rank checks what it can alone, then all compare notes before any group is made:
        # a rank that failed, or runs another schedule, stops everyone instead of hanging them
        error: Exception | None = None
        try:
            self.options = RunnerOptions.with_overrides(options, overrides)
            self._set_up_locally(schedule, stages, loss_fn, device)
        except Exception as failure:
            error = failure
        if store is not None:
            agree_on_setup(
                store, self.rank, self.world_size,
                None if error else describe(schedule, self.options.emulate is not None),
                None if error is None else f"{type(error).__name__}: {error}",
                self.options.setup_timeout if error is None else 0.0,
            )  # fmt: skip
        if error is not None:
            raise error
        if store is None:
            self._boundary = self._step_boundary()
            return
        options = self.options
        self._collectives = Collectives(
            self.group, self._global, self.rank, self.progress,
            early_first_word=options.step_boundary == "overlap",
        )  # fmt: skip
        self._boundary = self._step_boundary()
        make_transport = options.make_transport or default_transport
        self._transport = make_transport(
            TransportContext(
                self._program, self.group, self._global, self.device, self.progress, options
            )
        )
        self._guard = Guard(
            store, dist.distributed_c10d._get_default_store(), self.rank, self._global,
            self.progress, self._describe, heartbeat=options.heartbeat,
            dead_after=options.dead_after, exit_after=options.exit_after,
            step_timeout=options.step_timeout,
        )  # fmt: skip
        if self._mirrored:
            self._collectives.pair_with(self.world_size - 1 - self.rank)
            if options.sync_copies and options.emulate is None:
                self._collectives.copy_from_lower(self.parameters())

    def _step_boundary(self) -> StepBoundary:
        """How steps given an optimizer end (``cutpipe.runtime.step_boundary``); the gradient
        words travel on a channel of their own when the boundary needs them."""
        options = self.options
        channel = self._collectives.side_channel() if options.validates_steps else None
        device = self.device

        def start_gather(word: torch.Tensor) -> Callable[[], torch.Tensor]:
            assert channel is not None
            step = self.progress.step
            return channel.start(word.to(device), f"the gradient check of step {step}")

        copies = mirror_copies(self.schedule) if options.validates_steps else 1
        return StepBoundary(options, self.parameters, start_gather, copies)

    def _set_up_locally(
        self,
        schedule: Schedule,
        stages: Mapping[int, nn.Module] | None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
        device: torch.device | str | None,
    ) -> None:
        """Everything one rank can check and build without talking to the others."""
        options = self.options
        if not isinstance(schedule, Schedule):
            raise TypeError(
                f"schedule must be a cutpipe Schedule (from cutpipe.generate), got "
                f"{type(schedule).__name__}"
            )
        if schedule.num_ranks != self.world_size:
            raise ValueError(
                f"schedule {schedule.name!r} is for {schedule.num_ranks} ranks but the process group "
                f"has {self.world_size}: generate it for {self.world_size} ranks or pass the "
                "pipeline's own group"
            )
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        self._program = RankProgram(schedule, self.rank)
        self._forward_program: RankProgram | None = None
        held = self._program.stages
        if options.emulate is None:
            if stages is None or set(stages) != set(held):
                given = "none" if stages is None else ", ".join(map(str, sorted(stages)))
                raise ValueError(
                    f"rank {self.rank} holds stages {', '.join(map(str, held))} of {schedule.name!r}; "
                    f"it was given modules for stages {given}"
                )
            for stage, module in stages.items():
                if not isinstance(module, nn.Module):
                    raise TypeError(
                        f"stage {stage} must be a torch.nn.Module, got {type(module).__name__}"
                    )
            self.device = torch.device(device) if device is not None else _device_of(stages)
        else:
            self.device = torch.device(device or "cpu")
        self._modules = dict(stages or {})
        self._loss_fn = loss_fn
        make_executor = options.make_executor or default_executor
        self._executor: Executor = make_executor(
            ExecutorContext(schedule, self._program, self._modules, loss_fn, self.device, options)
        )
        self._mirrored = schedule.placement.num_pipes > 1
        self._reducer = options.reducer if options.emulate is None else None
        self._stage_parameters = _parameters_by_stage(self._program, self._modules)
        self._times: tuple[list[float], list[float]] | None = None
        self._recording = False  # whether the step running now is recorded
        self._ops: list = self._program.ops
        self._last_signature: list[int] | None = None
        self._handoff: dict[tuple[int, int, int], Value] = {}
        self._outbox = self._program.outbox

    def _store(self) -> dist.Store:
        """This runner's own corner of the c10d store (runners built in the same order on every
        rank get the same corner)."""
        store = dist.distributed_c10d._get_default_store()
        me = self._global[self.rank]
        instance = store.add(f"cutpipe/instances/{me}", 1)
        return dist.PrefixStore(f"cutpipe/{'-'.join(map(str, self._global))}/{instance}", store)

    @classmethod
    def from_sequential(
        cls,
        schedule: Schedule,
        model: nn.Sequential,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        partition: Sequence[int] | None = None,
        **options: Any,
    ) -> PipelineRunner:
        """``from_module`` with the items of ``list(model)`` as its blocks: consecutive layers,
        ``partition[s]`` of them in stage ``s`` (default: as even as possible). Layers may pass
        tuples along. The stages keep the model's names (``"5.weight"``, as in
        ``model.state_dict()``)."""
        return cls.from_module(
            schedule, model, loss_fn, partition, sequence_blocks(model), **options
        )

    @classmethod
    def from_module(
        cls,
        schedule: Schedule,
        model: nn.Module,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        split: Split = None,
        blocks: Sequence[str] | None = None,
        **options: Any,
    ) -> PipelineRunner:
        """A runner for this rank's stages of any ``model`` that runs ``blocks`` one after another
        (default: its children, ``nn.Sequential`` and ``nn.ModuleList`` ones expanded), cut at
        ``split``: the block names where stages 1, 2, ... begin, or blocks per stage (default:
        as even as possible). Every parameter keeps its name in the model, so
        ``named_parameters()`` and ``state_dict()`` match the unsplit model's
        (``cutpipe.runtime.stages`` has the whole contract)."""
        held = held_stages(schedule, options.get("group"))
        stages = cut_module(model, split, blocks=blocks, num_stages=schedule.num_stages, held=held)
        return cls(schedule, stages, loss_fn, **options)

    # -- what this rank holds ---------------------------------------------------------------------

    @property
    def loss_reduction(self) -> str:
        return self.options.loss_reduction

    @property
    def modules(self) -> dict[int, nn.Module]:
        """This rank's stage modules, by stage."""
        return dict(self._modules)

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters, stage by stage: what its optimizer should update."""
        seen: dict[int, nn.Parameter] = {}
        for stage in sorted(self._modules):
            for parameter in self._modules[stage].parameters():
                seen.setdefault(id(parameter), parameter)
        return list(seen.values())

    def named_parameters(self) -> dict[str, nn.Parameter]:
        """This rank's parameters by their names in the unsplit model (stages built by
        ``from_module`` or ``from_sequential``), each once: optimizer groups, checkpoints."""
        return named_parameters_of(self._modules)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's part of the unsplit model's ``state_dict``, under the same keys: the
        ranks' dicts together (DualPipe's copies agree) load into the unsplit model."""
        return state_dict_of(self._modules)

    @property
    def peak_activation_units(self) -> float:
        """The most activation units this rank held at once during the last step."""
        return self._executor.peak_units

    def _describe(self) -> str:
        """Where this rank is, for heartbeats and messages."""
        position = self._position
        if 0 <= position < len(self._ops):
            op = self._ops[position]
            return str(self.schedule.codec.decode(op.code))
        progress = self.progress
        if progress.in_step:
            return "the start or end of the step"
        if progress.waiting is not None or progress.between is not None:
            what = progress.waiting[1] if progress.waiting is not None else progress.between
            return f"{what} (after step {progress.step})"
        return "between steps" if progress.step else "its set-up, before any step"

    # -- a step ----------------------------------------------------------------------------------

    def _agree(self, training: bool, inputs: Any, targets: Any, batch: list[Any] | None,
               failed: bool) -> tuple[Callable[[], bool], Callable[[], bool]]:  # fmt: skip
        """Start the step's all-gather (``agreement``). The first returned call waits for it
        (once), stops this rank if any rank disagrees or could not start the step, and says
        whether rank 0's input signature is new (so boundary shapes are learned again); the
        second is what the transport asks before its first transfer.

        It runs in the background: only a transfer that must know the answer waits for it. With
        ``step_boundary="overlap"`` that transfer waits only for rank 0's word (the signature is
        in it): waiting for every rank's would make rank 0 wait for the last rank to finish the
        step before, which is the synchronisation overlap removes. A disagreement is then found
        when the step ends, or by the watchdog if a transfer it derails never comes."""
        if self.world_size == 1:
            return (lambda: False), (lambda: False)
        step = self.progress.step
        signature = torch.zeros(HEADER_LENGTH, dtype=torch.int64)
        if self.rank == 0 and batch:
            signature = encode_header([meta_of(batch[0])], torch.device("cpu"))
        word = step_word(
            training, step, batch_size(inputs), batch_size(targets), failed, signature
        ).to(self.device)
        words = self._collectives.start_gather(word, f"the agreement on step {step}")
        answer: list[bool] = []
        checked: list[bool] = []

        def learn(signature: list[int]) -> bool:
            if not answer:
                answer.append(signature != self._last_signature)
                self._last_signature = signature
            return answer[0]

        def from_rank_zero() -> bool:
            if answer:
                return answer[0]
            first = words.first()
            if first[FAILED_FIELD]:  # rank 0 could not start: the whole agreement says how
                return agreed()
            return learn(first[STEP_FIELDS:].tolist())

        def agreed() -> bool:
            if checked:
                return answer[0]
            checked.append(True)
            gathered = words()
            culprits = failed_ranks(gathered)
            if culprits and not failed:
                recorded = self._guard.failure() if self._guard is not None else None
                raise PipelineError(
                    (recorded or f"rank {culprits[0]} could not start step {step}")
                    + f"; rank {self.rank} stopped at the start of step {step}",
                    rank=culprits[0],
                )
            return learn(check_step(gathered))

        return agreed, (from_rank_zero if self.options.step_boundary == "overlap" else agreed)

    def step(
        self,
        inputs: Any = None,
        targets: Any = None,
        *,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> torch.Tensor | None:
        """Run one step; return the loss (mean or sum over the microbatches) on every rank.

        Under ``torch.no_grad()`` only the forwards run. Without targets (or a loss function) the
        last stage keeps its outputs for ``outputs()`` and the step returns None. Bad input raises
        on the rank that got it before any boundary value moves; the other ranks stop with a
        ``PipelineError`` that quotes it. Ranks that disagree on the step (grad mode, step count,
        batch size) all stop with a ``MismatchError`` saying who differs.

        With an ``optimizer`` the step ends with its step, at the options' ``step_boundary``,
        clipped and skipped as they say, and the gradients are gone afterwards. Without one the
        gradients stay for the caller's optimizer (the options may then ask for no clipping,
        skipping or overlap, which need the optimizer here).
        """
        if self._closed:  # its transport and groups are gone: a step would fail deep inside
            raise RuntimeError(
                f"rank {self.rank}: the runner is closed: build a new PipelineRunner to run more "
                "steps"
            )
        boundary = self._boundary
        if not torch.is_grad_enabled():
            if optimizer is not None:
                raise ValueError("a step under torch.no_grad() computes no gradients to step with")
            self.settle()  # forwards must see validated parameters
            return self._step(inputs, targets)
        validates = self.options.validates_steps
        if optimizer is None and not (validates and self.options.emulate is not None):
            if validates:  # emulation alone times the boundary without an optimizer
                raise ValueError(
                    "clip_grad_norm, skip_nonfinite and step_boundary='overlap' act on the "
                    "optimizer step: pass it, runner.step(inputs, targets, optimizer=optimizer)"
                )
            return self._step(inputs, targets)
        loss = self._step(inputs, targets)
        if boundary.settle():  # the last step was redone: this one ran on the wrong parameters
            for parameter in self.parameters():
                parameter.grad = None
            loss = self._step(inputs, targets)
        boundary.finish(optimizer, *self._loss_share())
        return loss

    def settle(self) -> Verdict | None:
        """Wait for the verdict on the last optimistic step (``step_boundary="overlap"``) and
        redo that step if it was wrong; the verdict on the last step, if there is one. Call it
        before reading the parameters (a checkpoint, an evaluation) and after the last step;
        steps under ``torch.no_grad()`` call it themselves."""
        self._boundary.settle()
        return self._boundary.last

    @property
    def verdict(self) -> Verdict | None:
        """The verdict on the latest step it has been read for: with ``step_boundary="sync"`` the
        last step's, with ``"overlap"`` the one before (or the last, after ``settle``)."""
        return self._boundary.last

    @property
    def rollbacks(self) -> int:
        """How many optimistic steps were rolled back and redone (``step_boundary="overlap"``)."""
        return self._boundary.rollbacks

    def _step(self, inputs: Any, targets: Any) -> torch.Tensor | None:
        """Run the pipeline once: forwards and backwards, gradients left in the parameters."""
        training = torch.is_grad_enabled()
        program = self._program if training else self._forward_only()
        self._ops, self._outbox = program.ops, program.outbox
        guard, progress, transport = self._guard, self.progress, self._transport
        progress.step += 1
        progress.in_step = True
        try:
            if guard is not None:
                guard.enter_step()
            try:
                batch, targets_by_microbatch = self._read_batch(program, training, inputs, targets)
                problem = None
            except (TypeError, ValueError) as error:
                batch, targets_by_microbatch, problem = None, [], error
                if guard is not None:
                    guard.record(
                        f"rank {self.rank} could not start step {progress.step}: "
                        f"{type(error).__name__}: {error}"
                    )
            agreed, learning = self._agree(training, inputs, targets, batch, problem is not None)
            if problem is not None:
                with contextlib.suppress(Exception):
                    agreed()  # the others are in the all-gather: complete it, then stop
                raise problem
            summed = training and self._mirrored and self.options.emulate is None
            if summed:
                _halve_carried(self.parameters())
            m = self.schedule.num_microbatches
            scale = 1.0 / m if self.options.loss_reduction == "mean" else 1.0
            self._executor.begin_step(targets_by_microbatch, scale)
            if transport is not None:
                transport.begin_step(program, learning)
            self._run(program, batch)
            if transport is not None:
                transport.end_step()
            agreed()  # settled before the step ends, whatever the transport did
            progress.ops_done += 1
            self._executor.end_step()
            if training and self._reducer is not None:
                self._reducer.finish()
            if summed:
                self._collectives.sum_copies(self.parameters())
            return self._total_loss()
        except PeerLost as lost:
            raise self._peer_failure(lost) from None
        except PipelineError:
            raise
        except BaseException as error:
            if guard is not None:
                guard.record(
                    f"rank {self.rank} failed in step {progress.step} at {self._describe()}: "
                    f"{type(error).__name__}: {error}"
                )
            raise
        finally:
            progress.in_step = False
            progress.done_waiting()
            if guard is not None:
                guard.leave_step()
            self._position = -1
            self._handoff.clear()

    def _read_batch(
        self, program: RankProgram, training: bool, inputs: Any, targets: Any
    ) -> tuple[list[Any] | None, list[Any]]:
        """This rank's microbatches of inputs and targets, or a ValueError saying what to pass."""
        stages = program.stages
        emulated = self.options.emulate is not None
        needs_inputs = 0 in stages and not emulated
        needs_targets = self.schedule.num_stages - 1 in stages and self._loss_fn is not None
        if needs_inputs and inputs is None:
            raise ValueError(
                f"rank {self.rank} holds the first stage: pass the batch's inputs to step()"
            )
        if training and needs_targets and targets is None:
            raise ValueError(
                f"rank {self.rank} holds the last stage: pass the targets to step() for training"
            )
        m = self.schedule.num_microbatches
        batch = to_microbatches(inputs, "inputs", m, self.device) if needs_inputs else None
        split_targets: list[Any] = []
        if needs_targets and targets is not None:
            split_targets = to_microbatches(targets, "targets", m, self.device)
            if isinstance(targets, torch.Tensor):
                split_targets = [t[0] for t in split_targets]
        if len({batch_size(inputs), batch_size(targets)} - {-1}) > 1:
            raise ValueError(
                f"the inputs have a batch of {batch_size(inputs)} but the targets of "
                f"{batch_size(targets)}: pass targets for the same samples as the inputs"
            )
        return batch, split_targets

    def _forward_only(self) -> RankProgram:
        if self._forward_program is None:
            self._forward_program = RankProgram(self.schedule, self.rank, forward_only=True)
        return self._forward_program

    def _peer_failure(self, lost: PeerLost) -> PipelineError:
        """The story of a broken connection: the failure on record, or what the peer left."""
        guard = self._guard
        assert guard is not None
        recorded = None
        for _ in range(20):  # the failed rank may still be writing its own account
            recorded = guard.failure() or guard.explain_loss(lost.peer)
            if recorded is not None:
                break
            time.sleep(0.1)
        if recorded is None:
            who = f"rank {lost.peer}" if lost.peer is not None else "a peer"
            recorded = f"{who} closed its connection to rank {self.rank} ({lost.reason})"
        recorded = guard.record(recorded)
        return PipelineError(
            f"{recorded}; rank {self.rank} stopped in step {self.progress.step} at "
            f"{self._describe()}",
            rank=lost.peer,
        )

    def _clock(self) -> float:
        """Seconds, for measured timelines; on a GPU after the queued kernels have finished
        (recording then serialises the GPU with the host: a diagnostic mode)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _run(self, program: RankProgram, batch: list[Any] | None) -> None:
        """Walk this rank's program: inputs from the transport (or this rank), the op on the
        executor, outputs to the transport (or this rank)."""
        # forward-only steps (an evaluation) are not recorded: timeline() keeps the last
        # training step's
        record = self._recording = self.options.record_timeline and torch.is_grad_enabled()
        starts: list[float] = []
        ends: list[float] = []
        origin = 0.0
        if record:
            self._collectives.barrier("the barrier that starts a recorded step")
            origin = self._clock()
        ops, transport, needs = program.ops, self._transport, program.needs
        depth = self.options.prefetch
        # under torch.profiler every op is a range named as torch's schedules name theirs
        labels = _profiler_labels(ops) if torch._C._autograd._profiler_enabled() else None
        reducer = self._reducer if torch.is_grad_enabled() else None
        grads_done = program.grads_done
        for index, op in enumerate(ops):
            self._position = index
            if transport is not None and index + depth < len(ops):
                for key, source in needs[index + depth]:
                    transport.prefetch(key, source)
            if labels is None:
                self._run_op(op, batch, index, starts, ends, origin)
            else:
                with torch.profiler.record_function(labels[index]):
                    self._run_op(op, batch, index, starts, ends, origin)
            if reducer is not None and index in grads_done:
                for stage in grads_done[index]:  # the stage's reduction hides behind the rest
                    reducer.stage_done(stage, self._stage_parameters[stage])
        if record:
            self._times = (starts, ends)

    def _run_op(
        self, op: Any, batch: list[Any] | None, index: int, starts: list[float],
        ends: list[float], origin: float,
    ) -> None:  # fmt: skip
        """Inputs from the transport (or this rank), the op on the executor, outputs to the
        transport (or this rank); its start and end times if the step is recorded."""
        executor, record, clock = self._executor, self._recording, self._clock
        if type(op) is Pair:
            values = self._input(op.forward, batch)
            grads = self._gradient(op.backward)
            if record:
                starts.append(clock() - origin)
            outputs: tuple = executor.pair(op.forward, values, op.backward, grads)
        elif op.kind == F_CODE:
            values = self._input(op, batch)
            if record:
                starts.append(clock() - origin)
            outputs = (executor.forward(op, values),)
        elif op.kind == W_CODE:
            if record:
                starts.append(clock() - origin)
            executor.weight(op)
            outputs = (None,)
        else:
            grads = self._gradient(op)
            if record:
                starts.append(clock() - origin)
            outputs = (executor.backward(op, grads),)
        self._deliver(index, op, outputs)
        self.progress.ops_done += 1
        if record:
            ends.append(clock() - origin)

    def _input(self, ins: Instruction, batch: list[Any] | None) -> Value:
        """A forward's input: its microbatch of the batch on the first stage, else a value."""
        return (
            (batch[ins.microbatch] if batch is not None else ()) if ins.first else self._take(ins)
        )

    def _gradient(self, ins: Instruction) -> Value | None:
        """A backward's output gradient: none on the last stage (the loss), else a value."""
        return None if ins.last else self._take(ins)

    def _take(self, ins: Instruction) -> Value:
        """The value ``ins`` waits for: handed over by this rank, or from the transport."""
        if ins.source is None:
            return self._handoff.pop(ins.awaits)
        assert self._transport is not None
        return self._transport.receive(ins.awaits, ins.source)

    def _deliver(self, index: int, op: Any, outputs: tuple[Value | None, ...]) -> None:
        """Hand each half's output to the next stage: locally, or in one parcel per rank."""
        by_key: dict[tuple[int, int, int], Value] = {}
        for half, value in zip(halves(op), outputs, strict=True):
            if value is None:
                continue
            key = half.makes
            if half.target is None:
                self._handoff[key] = value
            else:
                by_key[key] = value
        if by_key:
            assert self._transport is not None
            for dst, parcel in self._outbox[index]:
                self._transport.send(parcel, [by_key[key] for key in parcel], dst)

    def _local_losses(self) -> torch.Tensor:
        """The sum of this rank's microbatch losses of the last step and how many there were,
        on the device."""
        losses = self._executor.losses if self._loss_fn is not None else []
        local = torch.stack(losses).sum().float() if losses else torch.zeros(())
        count = torch.tensor(float(len(losses)), device=self.device)
        return torch.stack([local.to(self.device), count])

    def _reduced(self, total: torch.Tensor) -> torch.Tensor:
        """A sum of microbatch losses as the step's loss: divided by their count for "mean"."""
        m = self.schedule.num_microbatches
        return total / m if self.options.loss_reduction == "mean" else total

    def _loss_share(self) -> tuple[float, int]:
        """This rank's part of the last step's loss, and how many microbatch losses made it."""
        local = self._local_losses()
        return float(self._reduced(local[0])), int(local[1])

    def _total_loss(self) -> torch.Tensor | None:
        """The step's loss: the loss ranks' sums and counts, added up everywhere (or, with
        ``loss_on_every_rank=False``, this rank's own share, None on ranks that compute none)."""
        if self._loss_fn is None:
            return None
        summary = self._local_losses()
        if self.options.loss_everywhere:
            self._collectives.sum(summary, f"the loss all-reduce of step {self.progress.step}")
        return self._reduced(summary[0]) if int(summary[1]) else None

    def outputs(self) -> dict[int, Value]:
        """The last stage's outputs of the last step without targets, by microbatch (this rank's)."""
        return dict(self._executor.outputs)

    # -- measured timelines ---------------------------------------------------------------------

    def timeline(self) -> Timeline | None:
        """The last step's measured timeline of every rank, gathered on rank 0 (None elsewhere)."""
        return self.start_timeline()()

    def start_timeline(self) -> Callable[[], Timeline | None]:
        """``timeline()`` in two halves: start gathering the last step's times (every rank), and
        the returned call that waits for them, so that the wait hides behind what a rank does
        in between (the trainer's gradient norm and optimizer step)."""
        if self._times is None:
            raise ValueError("build the runner with record_timeline=True to measure timelines")
        # every rank's op count is known from the schedule: gather padded tensors, no pickling
        longest = max(map(len, self.schedule.codes))
        mine = torch.zeros(2, longest, dtype=torch.float64, device=self.device)
        count = len(self._times[0])
        mine[0, :count] = torch.tensor(self._times[0], dtype=torch.float64)
        mine[1, :count] = torch.tensor(self._times[1], dtype=torch.float64)
        gathering = self._collectives.start_gather_to_first(mine, "gathering the measured timeline")
        schedule = self.schedule

        def finish() -> Timeline | None:
            gathered = gathering()
            if gathered is None:
                return None
            counts = [len(ops) for ops in schedule.codes]
            starts = [g[0, :n].tolist() for g, n in zip(gathered, counts, strict=True)]
            ends = [g[1, :n].tolist() for g, n in zip(gathered, counts, strict=True)]
            return Timeline(schedule, starts, ends, unit="s", source="measured")

        return finish

    def close(self) -> None:
        """Stop the heartbeat, give the stage modules their own layers back, and let go of the
        process groups, so that ``destroy_process_group`` really ends them. Closing again does
        nothing; a ``step`` afterwards is a RuntimeError."""
        if self._closed:
            return
        self._closed = True
        if self._guard is not None:
            self._guard.close()
            self._guard = None
        self._executor.close()
        self._transport = None
        self._collectives = Alone()

    def __enter__(self) -> PipelineRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: torch's letters for F, B (input gradients only), W and a full backward
_LETTERS = {F_CODE: "F", B_CODE: "I", W_CODE: "W", BW_CODE: "B"}


def _action(ins: Instruction) -> str:
    return f"{ins.stage}{_LETTERS[ins.kind]}{ins.microbatch}"


def _profiler_labels(ops: Sequence[Any]) -> list[str]:
    """Profiler range names in torch's notation: ``PP:0F3``, ``PP:(0F7;7B3)OVERLAP_F_B``."""
    return [
        f"PP:({_action(op.forward)};{_action(op.backward)})OVERLAP_F_B"
        if type(op) is Pair
        else f"PP:{_action(op)}"
        for op in ops
    ]


@torch.no_grad()
def _parameters_by_stage(
    program: RankProgram, modules: Mapping[int, nn.Module]
) -> dict[int, list[nn.Parameter]]:
    """Each trainable parameter under the stage whose gradients complete last of those that use
    it (a weight two stages share is complete only after both), so that each is reduced once."""
    done_order = [
        stage for index in sorted(program.grads_done) for stage in program.grads_done[index]
    ]
    owner: dict[int, int] = {}
    unique: dict[int, nn.Parameter] = {}
    for stage in done_order:
        for parameter in modules[stage].parameters() if stage in modules else ():
            if parameter.requires_grad:
                owner[id(parameter)] = stage
                unique[id(parameter)] = parameter
    grouped: dict[int, list[nn.Parameter]] = {stage: [] for stage in done_order}
    for key, parameter in unique.items():
        grouped[owner[key]].append(parameter)
    return grouped


def _halve_carried(parameters: Sequence[nn.Parameter]) -> None:
    """DualPipe sums its two copies' whole gradients after a step; gradients carried in from
    earlier steps (accumulation) are the same on both copies, so each keeps half of them and the
    sum counts them once (halving is exact in binary floating point)."""
    for parameter in parameters:
        if parameter.grad is not None:
            parameter.grad.mul_(0.5)


def _device_of(stages: Mapping[int, nn.Module]) -> torch.device:
    for module in stages.values():
        for parameter in module.parameters():
            return parameter.device
    return torch.device("cpu")
