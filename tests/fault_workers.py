"""Faults injected into pipeline ranks: each function runs on every rank of a launched group
(spawned processes import this module) and reports how its rank ended."""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

import torch
from torch import nn

from cutpipe import Costs, generate
from cutpipe.models import mlp
from cutpipe.runtime import PipelineError, PipelineRunner


def _ended(error: BaseException, started: float) -> str:
    return f"{type(error).__name__} after {time.monotonic() - started:.1f}s: {error}"


def failing(rank: int, world: int, how: str, victim: int, name: str) -> str:
    """A long emulated step in which ``victim`` raises or is killed; report how each rank ended."""
    schedule = generate(name, world, 12)
    started = time.monotonic()
    runner = PipelineRunner(
        schedule, None, emulate=Costs(), time_unit=0.05, heartbeat=0.5, dead_after=5, exit_after=5
    )
    if rank == victim:

        def strike() -> None:
            time.sleep(1.5)
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            runner._executor.forward = _raising  # the next forward raises

        threading.Thread(target=strike, daemon=True).start()
    try:
        runner.step()
        return "finished"
    except PipelineError as error:
        return _ended(error, started)
    except ValueError as error:
        return f"ValueError: {error}"


def _raising(*_: object) -> None:
    raise ValueError("boom in a stage module")


def mismatches(rank: int, world: int) -> dict[str, str]:
    """Ranks that disagree, one case after the other: each must raise on every rank, at once."""
    outcomes: dict[str, str] = {}
    model = mlp(blocks=4, width=8)
    x, y = torch.randn(8, 8), torch.randn(8, 8)

    def attempt(case: str, build, use=None) -> None:
        started = time.monotonic()
        runner = None
        try:
            runner = build()
            if use is not None:
                use(runner)
            outcomes[case] = "no error"
        except (PipelineError, ValueError) as error:
            outcomes[case] = _ended(error, started)
        finally:
            if runner is not None:
                runner.close()

    m = 8 if rank == 0 else 4
    attempt("schedules", lambda: PipelineRunner.from_sequential(generate("1f1b", world, m), model))
    names = ["1f1b", "zbh1"]
    attempt(
        "names", lambda: PipelineRunner.from_sequential(generate(names[rank % 2], world, 4), model)
    )
    attempt(
        "emulated",
        lambda: (
            PipelineRunner.from_sequential(generate("1f1b", world, 4), model)
            if rank == 0
            else PipelineRunner(generate("1f1b", world, 4), None, emulate=Costs(), time_unit=0.001)
        ),
    )
    size = 8 if rank == 0 else 12
    attempt(
        "batch",
        lambda: PipelineRunner.from_sequential(generate("1f1b", world, 4), model, nn.MSELoss()),
        lambda runner: runner.step(torch.randn(size, 8), torch.randn(size, 8)),
    )

    def mixed_modes(runner: PipelineRunner) -> None:
        runner.step(x, y)
        with torch.set_grad_enabled(rank == 0):
            runner.step(x, y)

    attempt(
        "grad mode",
        lambda: PipelineRunner.from_sequential(generate("1f1b", world, 4), model, nn.MSELoss()),
        mixed_modes,
    )
    attempt(  # the set-up still works after all that: the same runner on every rank
        "agreed",
        lambda: PipelineRunner.from_sequential(generate("1f1b", world, 4), model, nn.MSELoss()),
        lambda runner: runner.step(x, y),
    )
    return outcomes


class Hanging(nn.Module):
    """A stage that never returns from the forward of one microbatch of the second step."""

    def __init__(self, inner: nn.Module, hang_on: int, how: str) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0
        self.hang_on = hang_on
        self.how = how

    def forward(self, x):
        self.calls += 1
        if self.calls == self.hang_on:
            if self.how == "gil":  # a C call that holds the GIL: the heartbeat thread cannot run
                ctypes.PyDLL(None).sleep(8)
            else:
                while True:  # alive, beating, and going nowhere
                    time.sleep(0.05)
        return self.inner(x)


def hang(rank: int, world: int, victim: int, how: str, step_timeout: float) -> str:
    """``victim``'s stage stops returning in the second step (``how="loop"``) or holds the GIL
    for 8 s (``how="gil"``, shorter than ``step_timeout``: a healthy rank that must survive)."""
    schedule = generate("1f1b", world, 4)
    model = mlp(blocks=2 * world, width=8)
    per = len(model) // world
    inner = nn.Sequential(*list(model)[rank * per : (rank + 1) * per])
    stage = Hanging(inner, hang_on=6, how=how) if rank == victim else inner
    runner = PipelineRunner(
        schedule, {rank: stage}, nn.MSELoss(), step_timeout=step_timeout, heartbeat=0.5,
        dead_after=2, exit_after=5,
    )  # fmt: skip
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    started = time.monotonic()
    try:
        losses = [float(runner.step(x, y)) for _ in range(2)]
        return f"finished: {losses}"
    except PipelineError as error:
        return _ended(error, started)
    finally:
        runner.close()


def frozen(rank: int, world: int, victim: int) -> str:
    """``victim`` stops itself (SIGSTOP) in the middle of a long emulated step."""
    schedule = generate("1f1b", world, 12)
    runner = PipelineRunner(
        schedule, None, emulate=Costs(), time_unit=0.05, heartbeat=0.5, dead_after=3,
        exit_after=3, step_timeout=120,
    )  # fmt: skip
    if rank == victim:
        threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGSTOP)).start()
    started = time.monotonic()
    try:
        runner.step()
        return "finished"
    except PipelineError as error:
        return _ended(error, started)


def frozen_between_steps(rank: int, world: int, victim: int) -> str:
    """``victim`` stops itself (SIGSTOP) after a step, before the gather of the step's timeline
    that the other ranks wait in: a wait between steps, which only the guard can end."""
    schedule = generate("1f1b", world, 4)
    runner = PipelineRunner(
        schedule, None, emulate=Costs(), time_unit=0.01, heartbeat=0.5, dead_after=3,
        exit_after=3, record_timeline=True,
    )  # fmt: skip
    runner.step()
    if rank == victim:
        os.kill(os.getpid(), signal.SIGSTOP)
    runner.timeline()
    return "finished"


def between_steps(rank: int, world: int, victim: int, how: str) -> str:
    """``victim`` fails after its first step: it raises (as data loading might) or its process
    ends with ``os._exit`` in the middle of the second step's forward."""
    schedule = generate("1f1b", world, 4)
    model = mlp(blocks=2 * world, width=8)
    runner = PipelineRunner.from_sequential(
        schedule, model, nn.MSELoss(), heartbeat=0.5, dead_after=5, exit_after=5
    )
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    started = time.monotonic()
    try:
        runner.step(x, y)
        if rank == victim:
            if how == "raise":
                raise ValueError("the data loader broke")
            module = runner.modules[rank]
            module.register_forward_hook(lambda *_: os._exit(3))
        runner.step(x, y)
        return "finished"
    except PipelineError as error:
        return _ended(error, started)


def lingering(rank: int, world: int) -> str:
    """Rank 0 raises at once; the others sleep, talking to nobody (no runner guards them)."""
    if rank == 0:
        raise ValueError("rank 0 gives up")
    time.sleep(600)
    return "woke up"


def sleeping(rank: int, world: int) -> str:
    time.sleep(600)
    return "woke up"
