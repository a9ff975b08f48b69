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
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cutpipe.runtime.agreement import agree_on_setup, check_step, describe, failed_ranks, step_word
from cutpipe.runtime.chain import Chain
from cutpipe.runtime.comm import HEADER_LENGTH, Mailbox, PeerLost, encode_header, meta_of, wait
from cutpipe.runtime.emulate import EmulatedExecutor
from cutpipe.runtime.executor import StageExecutor, Value
from cutpipe.runtime.flat import reduce_gradients, share_values
from cutpipe.runtime.guard import Guard, PipelineError
from cutpipe.runtime.heartbeat import Progress
from cutpipe.runtime.program import ACTIVATION, GRADIENT, Instruction, Pair, RankProgram, halves
from cutpipe.schedule.codes import F_CODE, W_CODE
from cutpipe.schedule.schedule import Schedule
from cutpipe.sim.costs import Costs
from cutpipe.sim.timeline import Timeline

#: seconds a rank may go without completing an op before the watchdog stops the pipeline
DEFAULT_STEP_TIMEOUT = 600.0
#: how long set-up waits for the other ranks when the progress watchdog is off
NO_TIMEOUT = 1800.0


def _check_timeouts(
    step_timeout: float | None, heartbeat: float, dead_after: float, exit_after: float
) -> None:
    for name, value in (("heartbeat", heartbeat), ("dead_after", dead_after),
                        ("exit_after", exit_after), ("step_timeout", step_timeout)):  # fmt: skip
        if name == "step_timeout" and value is None:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value <= 0
        ):
            raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    if step_timeout is not None and step_timeout <= heartbeat:
        raise ValueError(
            f"step_timeout ({step_timeout:g} s) must be longer than the heartbeat ({heartbeat:g} s)"
        )


def _tensors(value: Any, name: str) -> tuple[torch.Tensor, ...]:
    """A tensor or a tuple/list of tensors, as a tuple, or a TypeError naming ``name``."""
    tensors = (value,) if isinstance(value, torch.Tensor) else value
    if not isinstance(tensors, (tuple, list)) or not tensors:
        raise TypeError(
            f"{name} must be a tensor or a tuple of tensors, got {type(value).__name__}"
        )
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"{name} must be a tensor or a tuple of tensors, got a {type(tensor).__name__} in it"
            )
    return tuple(tensors)


def _batch_size(value: Any) -> int:
    """The batch (dim 0) size of a tensor or of a tuple's first tensor; -1 if there is none."""
    first = value[0] if isinstance(value, (tuple, list)) and value else value
    if isinstance(first, torch.Tensor) and first.dim() > 0:
        return int(first.shape[0])
    return -1


def collective(operation: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run a collective; a connection broken by a failed peer becomes ``PeerLost``."""
    try:
        return operation(*args, **kwargs)
    except RuntimeError as error:
        raise PeerLost(None, str(error)) from error


def stage_sizes(
    num_layers: int, num_stages: int, partition: Sequence[int] | None = None
) -> list[int]:
    """Layers per stage: ``partition`` checked, or an even split (earlier stages take the rest)."""
    if partition is None:
        if num_layers < num_stages:
            raise ValueError(
                f"{num_layers} layers cannot fill {num_stages} stages: use a deeper model or fewer stages"
            )
        base, extra = divmod(num_layers, num_stages)
        return [base + (s < extra) for s in range(num_stages)]
    sizes = list(partition)
    if len(sizes) != num_stages or sum(sizes) != num_layers or min(sizes) < 1:
        raise ValueError(
            f"partition {sizes} must give each of the {num_stages} stages at least one layer and "
            f"{num_layers} layers in all"
        )
    return sizes


class PipelineRunner:
    """Executes this rank's part of a schedule, step after step."""

    def __init__(
        self,
        schedule: Schedule,
        stages: Mapping[int, nn.Module] | None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        loss_reduction: str = "mean",
        split_backward: bool = True,
        emulate: Costs | None = None,
        time_unit: float = 0.01,
        w_memory: float = 0.5,
        dynamic_shapes: bool = False,
        sync_copies: bool = True,
        record_timeline: bool = False,
        prefetch: int = 16,
        loss_on_every_rank: bool = True,
        check_finite: bool = False,
        step_timeout: float | None = DEFAULT_STEP_TIMEOUT,
        heartbeat: float = 1.0,
        dead_after: float = 20.0,
        exit_after: float = 10.0,
    ) -> None:
        self.schedule = schedule
        if dist.is_available() and dist.is_initialized():
            self.group = group or dist.group.WORLD
            self.rank = dist.get_rank(self.group)
            self.world_size = dist.get_world_size(self.group)
            self._global = [dist.get_global_rank(self.group, r) for r in range(self.world_size)]
        elif group is None and getattr(schedule, "num_ranks", None) == 1:
            self.group, self.rank, self.world_size, self._global = None, 0, 1, [0]
        else:
            raise ValueError(
                "torch.distributed is not initialized: start one process per rank (torchrun, or "
                "cutpipe.runtime.launch) and call torch.distributed.init_process_group first"
            )
        self.progress = Progress()
        self._position = -1
        self._guard: Guard | None = None
        self._mailbox: Mailbox | None = None
        self._mirror: dist.ProcessGroup | None = None
        store = self._store() if self.world_size > 1 else None
        # every rank checks what it can alone, then all compare notes before any group is made:
        # a rank that failed, or runs another schedule, stops everyone instead of hanging them
        try:
            _check_timeouts(step_timeout, heartbeat, dead_after, exit_after)
            self._set_up_locally(
                schedule, stages, loss_fn, device, loss_reduction, split_backward, emulate,
                time_unit, w_memory, record_timeline, prefetch, check_finite,
            )  # fmt: skip
            error = None
        except Exception as failure:
            error = failure
        if store is not None:
            agree_on_setup(
                store, self.rank, self.world_size,
                None if error else describe(schedule, emulate is not None),
                None if error is None else f"{type(error).__name__}: {error}",
                step_timeout if step_timeout is not None else NO_TIMEOUT,
            )  # fmt: skip
        if error is not None:
            raise error
        self._loss_everywhere = loss_on_every_rank
        if store is None:
            return
        upward = dist.new_group(self._global, use_local_synchronization=True)
        downward = dist.new_group(self._global, use_local_synchronization=True)
        self._mailbox = Mailbox(
            self._program, self._global, upward, downward, self.device, dynamic_shapes,
            self.progress,
        )  # fmt: skip
        self._guard = Guard(
            store, dist.distributed_c10d._get_default_store(), self.rank, self._global,
            self.progress, self._describe, heartbeat=heartbeat, dead_after=dead_after,
            exit_after=exit_after, step_timeout=step_timeout,
        )  # fmt: skip
        if schedule.placement.num_pipes > 1:
            mirror = sorted(
                {self._global[self.rank], self._global[self.world_size - 1 - self.rank]}
            )
            self._mirror = dist.new_group(mirror, use_local_synchronization=True)
            if sync_copies and not self._emulated:
                self._copy_parameters_from(mirror[0])

    def _set_up_locally(
        self,
        schedule: Schedule,
        stages: Mapping[int, nn.Module] | None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
        device: torch.device | str | None,
        loss_reduction: str,
        split_backward: bool,
        emulate: Costs | None,
        time_unit: float,
        w_memory: float,
        record_timeline: bool,
        prefetch: int,
        check_finite: bool,
    ) -> None:
        """Everything one rank can check and build without talking to the others."""
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
        if loss_reduction not in ("sum", "mean"):
            raise ValueError(f"loss_reduction must be 'sum' or 'mean', got {loss_reduction!r}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise ValueError(
                f"prefetch is how many ops ahead receives are posted; it must be an int >= 1, "
                f"got {prefetch!r}"
            )
        self.loss_reduction = loss_reduction
        self._program = RankProgram(schedule, self.rank)
        self._forward_program: RankProgram | None = None
        held = self._program.stages
        if emulate is None:
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
            self.device = torch.device(device) if device is not None else self._device_of(stages)
            self._executor: StageExecutor | EmulatedExecutor = StageExecutor(
                stages, loss_fn, self._program.split_slots, split_backward, w_memory, check_finite
            )
        else:
            self.device = torch.device(device or "cpu")
            self._executor = EmulatedExecutor(schedule, emulate, time_unit, w_memory, self.device)
        self._modules = dict(stages or {})
        self._loss_fn = loss_fn
        self._emulated = emulate is not None
        self._record = record_timeline
        self._prefetch = prefetch
        self._times: tuple[list[float], list[float]] | None = None
        self._ops: list = self._program.ops
        self._last_signature: list[int] | None = None
        self._pending_collectives: list[Any] = []
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
        """A runner for this rank's stages of ``model``: consecutive layers, ``partition[s]`` of
        them in stage ``s`` (default: as even as possible). Layers may pass tuples along."""
        group = options.get("group")
        rank = dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0
        sizes = stage_sizes(len(model), schedule.num_stages, partition)
        bounds = [sum(sizes[:s]) for s in range(len(sizes) + 1)]
        layers = list(model)
        stages = {
            s: Chain(*layers[bounds[s] : bounds[s + 1]]) for s in schedule.placement.stages_of(rank)
        }
        return cls(schedule, stages, loss_fn, **options)

    # -- set-up --------------------------------------------------------------------------------

    @staticmethod
    def _device_of(stages: Mapping[int, nn.Module]) -> torch.device:
        for module in stages.values():
            for parameter in module.parameters():
                return parameter.device
        return torch.device("cpu")

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

    def _copy_parameters_from(self, source: int) -> None:
        """Make DualPipe's two copies of each stage start equal (the lower rank's wins)."""
        share_values(
            self.parameters(), lambda flat: dist.broadcast(flat, src=source, group=self._mirror)
        )

    # -- a step ----------------------------------------------------------------------------------

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
        if self.progress.in_step:
            return "the start or end of the step"
        return "between steps" if self.progress.step else "its set-up, before any step"

    def _microbatches(self, value: Any, name: str) -> list[tuple[torch.Tensor, ...]]:
        """Split a tensor or tuple of tensors along dim 0 into the schedule's microbatches."""
        m = self.schedule.num_microbatches
        tensors = _tensors(value, name)
        for tensor in tensors:
            if tensor.dim() == 0 or tensor.shape[0] == 0:
                raise ValueError(
                    f"{name} has {'no batch dimension' if tensor.dim() == 0 else 'an empty batch'}"
                    f": pass a batch of {m} or more samples (a multiple of {m}) along dim 0"
                )
            if tensor.shape[0] % m:
                raise ValueError(
                    f"{name} has batch size {tensor.shape[0]}, which does not split into {m} equal "
                    f"microbatches: use a batch size divisible by {m}"
                )
        chunks = [t.to(self.device, non_blocking=True).chunk(m) for t in tensors]
        return [tuple(chunk[i] for chunk in chunks) for i in range(m)]

    def _agree(self, training: bool, inputs: Any, targets: Any, batch: list[Any] | None,
               failed: bool) -> Callable[[], bool]:  # fmt: skip
        """Start the step's all-gather (see ``agreement``); the returned call waits for it, stops
        this rank if any rank disagrees or failed to start the step, and says whether rank 0's
        input signature is new (so boundary shapes are learned again).

        It runs in the background: only a transfer that must know the answer waits for it."""
        if self._mailbox is None:
            return lambda: False
        signature = torch.zeros(HEADER_LENGTH, dtype=torch.int64)
        if self.rank == 0 and batch:
            signature = encode_header([meta_of(batch[0])], torch.device("cpu"))
        mine = step_word(
            training, self.progress.step, _batch_size(inputs), _batch_size(targets), failed,
            signature,
        ).to(self.device)  # fmt: skip
        words = [torch.empty_like(mine) for _ in range(self.world_size)]
        work = collective(dist.all_gather, words, mine, group=self.group, async_op=True)
        self._pending_collectives.append(work)
        step = self.progress.step

        def changed() -> bool:
            self.progress.wait_for(None, f"the agreement on step {step}")
            wait(work, None)
            self.progress.done_waiting()
            gathered = torch.stack(words).cpu()
            culprits = failed_ranks(gathered)
            if culprits and not failed:
                recorded = self._guard.failure() if self._guard is not None else None
                raise PipelineError(
                    (recorded or f"rank {culprits[0]} could not start step {step}")
                    + f"; rank {self.rank} stopped at the start of step {step}",
                    rank=culprits[0],
                )
            values = check_step(gathered)
            new, self._last_signature = values != self._last_signature, values
            return new

        return changed

    def step(self, inputs: Any = None, targets: Any = None) -> torch.Tensor | None:
        """Run one step; return the loss (mean or sum over the microbatches) on every rank.

        Under ``torch.no_grad()`` only the forwards run. Without targets (or a loss function) the
        last stage keeps its outputs for ``outputs()`` and the step returns None. Bad input raises
        on the rank that got it before any boundary value moves; the other ranks stop with a
        ``PipelineError`` that quotes it. Ranks that disagree on the step (grad mode, step count,
        batch size) all stop with a ``MismatchError`` saying who differs.
        """
        training = torch.is_grad_enabled()
        program = self._program if training else self._forward_only()
        self._ops, self._outbox = program.ops, program.outbox
        guard, progress = self._guard, self.progress
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
            agreed = self._agree(training, inputs, targets, batch, problem is not None)
            if problem is not None:
                with contextlib.suppress(Exception):
                    agreed()  # the others are in the all-gather: complete it, then stop
                raise problem
            m = self.schedule.num_microbatches
            scale = 1.0 / m if self.loss_reduction == "mean" else 1.0
            self._executor.begin_step(targets_by_microbatch, scale)
            if self._mailbox is not None:
                self._mailbox.begin_step(program, agreed)
            self._run(program, batch)
            if self._mailbox is not None:
                self._mailbox.end_step()
            progress.ops_done += 1
            for work in self._pending_collectives:
                progress.wait_for(None, f"the agreement on step {progress.step}")
                wait(work, None)
            progress.done_waiting()
            self._executor.end_step()
            if training and self._mirror is not None and not self._emulated:
                self._sum_copies()
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
            self._pending_collectives.clear()

    def _read_batch(
        self, program: RankProgram, training: bool, inputs: Any, targets: Any
    ) -> tuple[list[Any] | None, list[Any]]:
        """This rank's microbatches of inputs and targets, or a ValueError saying what to pass."""
        stages = program.stages
        needs_inputs = 0 in stages and not self._emulated
        needs_targets = self.schedule.num_stages - 1 in stages and self._loss_fn is not None
        if needs_inputs and inputs is None:
            raise ValueError(
                f"rank {self.rank} holds the first stage: pass the batch's inputs to step()"
            )
        if training and needs_targets and targets is None:
            raise ValueError(
                f"rank {self.rank} holds the last stage: pass the targets to step() for training"
            )
        if self._record and not training:
            raise ValueError(
                "record_timeline measures training steps; run step() with grad enabled"
            )
        batch = self._microbatches(inputs, "inputs") if needs_inputs else None
        split_targets: list[Any] = []
        if needs_targets and targets is not None:
            split_targets = self._microbatches(targets, "targets")
            if isinstance(targets, torch.Tensor):
                split_targets = [t[0] for t in split_targets]
        if len({_batch_size(inputs), _batch_size(targets)} - {-1}) > 1:
            raise ValueError(
                f"the inputs have a batch of {_batch_size(inputs)} but the targets of "
                f"{_batch_size(targets)}: pass targets for the same samples as the inputs"
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
        executor, record = self._executor, self._record
        starts: list[float] = []
        ends: list[float] = []
        progress = self.progress
        if record:
            if self.group is not None:
                progress.wait_for(None, "the barrier that starts a recorded step")
                collective(dist.barrier, group=self.group)
                progress.done_waiting()
            origin = self._clock()
        clock = self._clock
        ops, mailbox, needs, depth = program.ops, self._mailbox, program.needs, self._prefetch
        for index, op in enumerate(ops):
            self._position = index
            if mailbox is not None and index + depth < len(ops):
                for key, source in needs[index + depth]:
                    mailbox.prefetch(key, source)
            # an op starts when its inputs are here: waiting for them is idle time, not work
            if type(op) is Pair:
                forward, backward = op.forward, op.backward
                values = self._input(forward, batch)
                grads = self._gradient(backward)
                if record:
                    starts.append(clock() - origin)
                outputs = executor.pair(forward, values, backward, grads)
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
            progress.ops_done += 1
            if record:
                ends.append(clock() - origin)
        self._times = (starts, ends) if record else None

    def _input(self, ins: Instruction, batch: list[Any] | None) -> Value:
        if ins.first:
            return batch[ins.microbatch] if batch is not None else ()
        if ins.source is None:
            return self._handoff.pop((ACTIVATION, ins.stage - 1, ins.microbatch))
        assert self._mailbox is not None
        return self._mailbox.receive(ins.receives, ins.source)

    def _gradient(self, ins: Instruction) -> Value | None:
        if ins.last:
            return None
        if ins.source is None:
            return self._handoff.pop((GRADIENT, ins.stage + 1, ins.microbatch))
        assert self._mailbox is not None
        return self._mailbox.receive(ins.receives, ins.source)

    def _deliver(self, index: int, op: Any, outputs: tuple[Value | None, ...]) -> None:
        """Hand each half's output to the next stage: locally, or in one parcel per rank."""
        by_key: dict[tuple[int, int, int], Value] = {}
        for half, value in zip(halves(op), outputs, strict=True):
            if value is None:
                continue
            direction = ACTIVATION if half.kind == F_CODE else GRADIENT
            key = (direction, half.stage, half.microbatch)
            if half.target is None:
                self._handoff[key] = value
            else:
                by_key[key] = value
        if by_key:
            assert self._mailbox is not None
            for dst, parcel in self._outbox[index]:
                self._mailbox.send(parcel, [by_key[key] for key in parcel], dst)

    def _sum_copies(self) -> None:
        """Add up the gradients of DualPipe's two copies of each stage (this rank and its mirror)."""
        mirror = self.world_size - 1 - self.rank
        self.progress.wait_for(mirror, f"the sum of DualPipe's two copies with rank {mirror}")
        reduce_gradients(
            self.parameters(), lambda flat: collective(dist.all_reduce, flat, group=self._mirror)
        )
        self.progress.done_waiting()

    def _total_loss(self) -> torch.Tensor | None:
        """The step's loss: the loss ranks' sums and counts, added up everywhere (or, with
        ``loss_on_every_rank=False``, this rank's own share, None on ranks that compute none)."""
        if self._loss_fn is None:
            return None
        losses = self._executor.losses
        local = torch.stack(losses).sum().float() if losses else torch.zeros(())
        summary = torch.stack(
            [local.to(self.device), torch.tensor(float(len(losses)), device=self.device)]
        )
        if self.group is not None and self._loss_everywhere:
            self.progress.wait_for(None, f"the loss all-reduce of step {self.progress.step}")
            collective(dist.all_reduce, summary, group=self.group)
            self.progress.done_waiting()
        total, count = summary[0], int(summary[1])
        if count == 0:
            return None
        return total / self.schedule.num_microbatches if self.loss_reduction == "mean" else total

    def outputs(self) -> dict[int, Value]:
        """The last stage's outputs of the last step without targets, by microbatch (this rank's)."""
        return dict(self._executor.outputs)

    # -- measured timelines ---------------------------------------------------------------------

    def timeline(self) -> Timeline | None:
        """The last step's measured timeline of every rank, gathered on rank 0 (None elsewhere)."""
        if self._times is None:
            raise ValueError("build the runner with record_timeline=True to measure timelines")
        if self.group is None:
            return Timeline(
                self.schedule, [self._times[0]], [self._times[1]], unit="s", source="measured"
            )
        # every rank's op count is known from the schedule: gather padded tensors, no pickling
        longest = max(map(len, self.schedule.codes))
        mine = torch.zeros(2, longest, dtype=torch.float64, device=self.device)
        count = len(self._times[0])
        mine[0, :count] = torch.tensor(self._times[0], dtype=torch.float64)
        mine[1, :count] = torch.tensor(self._times[1], dtype=torch.float64)
        gathered = (
            [torch.empty_like(mine) for _ in range(self.world_size)] if self.rank == 0 else None
        )
        collective(dist.gather, mine, gathered, dst=self._global[0], group=self.group)
        if gathered is None:
            return None
        counts = [len(ops) for ops in self.schedule.codes]
        starts = [g[0, :n].tolist() for g, n in zip(gathered, counts, strict=True)]
        ends = [g[1, :n].tolist() for g, n in zip(gathered, counts, strict=True)]
        return Timeline(self.schedule, starts, ends, unit="s", source="measured")

    def close(self) -> None:
        """Stop the heartbeat and give the stage modules their own layers back."""
        if self._guard is not None:
            self._guard.close()
            self._guard = None
        self._executor.close()

    def __enter__(self) -> PipelineRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
