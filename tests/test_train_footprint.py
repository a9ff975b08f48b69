"""The memory a run needs, estimated before any process starts: each rank's parameters exactly
as it builds them (only its own blocks), a model that cannot fit refused in one line with the
figures and the cheapest change, and a worker the out-of-memory killer ended named as such."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from cutpipe.cli.main import main
from cutpipe.cli.train import out_of_memory
from cutpipe.train import footprint
from cutpipe.train.footprint import GIB, estimate, oom_kills
from cutpipe.train.layout import run_layout
from cutpipe.train.options import TrainOptions
from cutpipe.train.tasks import task_for
from cutpipe.train.trainer import held_blocks

EXAMPLES = Path(__file__).parent.parent / "examples" / "models"


@pytest.mark.parametrize("model", ["tiny-moe.yaml", "tiny-dense.yaml"])
@pytest.mark.parametrize(("schedule", "ranks"), [("dualpipev", 2), ("dualpipe", 4), ("1f1b", 2)])
def test_each_ranks_parameters_are_the_ones_it_builds(model, schedule, ranks):
    options = TrainOptions.build(model=str(EXAMPLES / model), schedule=schedule, nproc=ranks)
    task = task_for(options)
    layout = run_layout(options, ranks, task)
    estimated = estimate(task, layout, options)
    for rank in range(ranks):
        stages = layout.schedule.placement.stages_of(rank)  # DualPipe's mirrors count twice
        built = task.build(0, held_blocks(layout.stage_sizes, stages))
        held = sum(
            p.numel()
            for stage in stages
            for block in held_blocks(layout.stage_sizes, [stage])
            for p in built[block].parameters()
        )
        assert estimated.parameters[rank] == held
        assert estimated.state[rank] == 16 * held  # fp32 weights, gradients, AdamW's moments
        assert estimated.activations[rank] > 0


def _train(capsys, *args: str) -> tuple[int, str]:
    code = main(["train", *args])
    return code, capsys.readouterr().err


def test_a_model_too_big_for_the_machine_is_refused_up_front(capsys, monkeypatch):
    monkeypatch.setattr(footprint, "available_memory", lambda: 20.0 * GIB)
    code, err = _train(
        capsys, "--model", str(EXAMPLES / "dense-7b.yaml"), "-s", "dualpipev", "-n", "2"
    )
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("cutpipe train: error: dense-7b does not fit: the 2 processes need")
    assert "this machine has 20 GiB available" in err
    assert "of weights, gradients and AdamW state for 3,702.7 M parameters" in err
    assert "spread it over about" in err


def test_the_cheapest_change_that_fits_is_named(monkeypatch):
    options = TrainOptions.build(
        model=str(EXAMPLES / "tiny-moe.yaml"), schedule="dualpipev", nproc=2, global_batch=256
    )
    task = task_for(options)
    layout = run_layout(options, 2, task)
    needed = estimate(task, layout, options).on_machine(2, 1)
    recomputed = estimate(task, layout, options.replace(recompute="full")).on_machine(2, 1)
    assert recomputed < needed
    monkeypatch.setattr(footprint, "available_memory", lambda: (needed + recomputed) / 2)
    with pytest.raises(ValueError, match=r"does not fit: .*; --recompute full brings it to about"):
        footprint.check_host_memory(task, layout, options)
    monkeypatch.setattr(footprint, "available_memory", lambda: needed * 1.01)
    assert footprint.check_host_memory(task, layout, options).on_machine(2, 1) == needed


def test_a_worker_the_oom_killer_ended_is_said_to_have_run_out_of_memory(tmp_path):
    vmstat = tmp_path / "vmstat"
    vmstat.write_text("pgfault 12\noom_kill 3\n")
    assert oom_kills(str(vmstat)) == 3
    assert oom_kills(str(tmp_path / "missing")) is None
    options = TrainOptions.build(model=str(EXAMPLES / "tiny-moe.yaml"), schedule="1f1b", nproc=2)
    killed = SimpleNamespace(cause=SimpleNamespace(kind="SIGKILL", rank=1))
    line = out_of_memory(killed, 3, 4, None, options)
    assert line == (
        "rank 1 ran out of memory (the kernel's out-of-memory killer ended it): use fewer "
        "processes per machine, --recompute full, or a smaller model"
    )
    assert out_of_memory(killed, 3, 3, None, options) is None  # killed by someone else
    failed = SimpleNamespace(cause=SimpleNamespace(kind="ValueError", rank=1))
    assert out_of_memory(failed, 3, 4, None, options) is None
