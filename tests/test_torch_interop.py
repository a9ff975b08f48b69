"""PyTorch 2.13's torch.distributed.pipelining as an independent checker.

Every schedule torch can express passes torch's own validator and send/receive lowering, and our
DualPipeV and ZB-V orders are identical to torch's ScheduleDualPipeV and ScheduleZBVZeroBubble
wherever torch accepts the shape. Torch's orders are obtained without a process group, from
mocked stages. (Torch's Schedule1F1B order is wrong on its last rank and is not used.)
"""

from unittest import mock

import pytest
import torch
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining.stage import PipelineStage

from cutpipe.interop.torch_pipelining import (
    expressible,
    from_torch,
    from_torch_actions,
    stage_to_rank,
    to_torch,
    to_torch_actions,
)
from cutpipe.schedule import Placement, generate, validate
from cutpipe.schedule.registry import SCHEDULES


def torch_order(schedule_class, ranks: int, microbatches: int) -> dict:
    stages = []
    for local in range(2):
        stage = mock.create_autospec(PipelineStage, instance=True)
        stage.group_rank, stage.group_size = 0, ranks
        stage.num_stages, stage.stage_index = 2 * ranks, local
        stage.submod = torch.nn.Linear(1, 1)
        stages.append(stage)
    return schedule_class(stages, microbatches, loss_fn=lambda out, target: out).pipeline_order


SHAPES = [(r, m) for r in range(1, 9) for m in range(1, 25)]


@pytest.mark.parametrize(
    ("name", "schedule_class"),
    [
        ("dualpipev", torch_schedules.ScheduleDualPipeV),
        ("zbv", torch_schedules.ScheduleZBVZeroBubble),
    ],
)
def test_v_schedules_match_torch_op_for_op(name, schedule_class):
    compared = 0
    for ranks, m in SHAPES:
        try:
            order = torch_order(schedule_class, ranks, m)
        except ValueError:  # torch's DualPipeV needs m >= 2R; ours goes down to 2R-1
            assert name == "dualpipev" and m < 2 * ranks
            continue
        theirs = from_torch_actions(name, Placement.vshape(ranks), m, order)
        assert generate(name, ranks, m) == theirs, f"{name} R={ranks} m={m}"
        compared += 1
    assert compared == {"dualpipev": 128, "zbv": 192}[name]  # 320 shapes torch accepts


@pytest.mark.parametrize("name", [n for n in SCHEDULES if n != "dualpipe"])
def test_torch_validates_and_lowers_every_expressible_schedule(name):
    from collections import Counter

    info = SCHEDULES[name]
    for ranks in range(1, 7):
        for m in range(info.min_microbatches(ranks), 17):
            if not info.accepts(ranks, m):
                continue
            schedule = generate(name, ranks, m)
            assert expressible(schedule)
            actions = to_torch_actions(schedule)
            torch_schedules._validate_schedule(actions, ranks, schedule.num_stages, m)
            lowered = torch_schedules._add_send_recv(
                {r: list(a) for r, a in actions.items()},
                stage_to_rank(schedule),
                schedule.num_stages,
            )
            # each rank keeps its compute in order and gains exactly one SEND per value it sends
            # across a boundary of cutpipe's placement, and the peer the matching RECV
            comm = {"SEND_F", "RECV_F", "SEND_B", "RECV_B"}
            ranks_of, expected = schedule.placement.pipes[0], {r: Counter() for r in actions}
            for s in range(schedule.num_stages - 1):
                here, there = ranks_of[s], ranks_of[s + 1]
                if here != there:
                    for i in range(m):
                        expected[here].update([("SEND_F", s, i), ("RECV_B", s, i)])
                        expected[there].update([("RECV_F", s + 1, i), ("SEND_B", s + 1, i)])
            for r, program in lowered.items():
                compute = [a for a in program if a.computation_type.name not in comm]
                sent = Counter(
                    (a.computation_type.name, a.stage_index, a.microbatch_index)
                    for a in program
                    if a.computation_type.name in comm
                )
                assert compute == actions[r] and sent == expected[r], f"R={ranks} m={m} rank {r}"


def test_torch_text_and_ours_agree():
    schedule = generate("dualpipev", 2, 4)
    exported = to_torch_actions(schedule)
    assert [[str(a) for a in exported[r]] for r in range(2)] == [
        [str(op) for op in ops] for ops in schedule.actions
    ]
    for ops in exported.values():
        for action in ops:
            assert str(torch_schedules._Action.from_str(str(action))) == str(action)


def test_dualpipe_is_not_expressible_in_torch():
    schedule = generate("dualpipe", 4, 8)
    assert not expressible(schedule)
    with pytest.raises(ValueError, match="cannot express"):
        to_torch_actions(schedule)


def test_imported_torch_schedules_can_be_simulated():
    order = torch_order(torch_schedules.ScheduleZBVZeroBubble, 4, 8)
    schedule = from_torch_actions("torch-zbv", Placement.vshape(4), 8, order)
    validate(schedule)


def torch_schedule(schedule_class, ranks: int, microbatches: int):
    """A torch schedule object for rank 0 of ``ranks``, built from mocked stages (no process
    group): what torch's own constructor makes of that shape."""
    single = schedule_class in (torch_schedules.ScheduleGPipe, torch_schedules.Schedule1F1B)
    v_shape = schedule_class in (
        torch_schedules.ScheduleZBVZeroBubble,
        torch_schedules.ScheduleDualPipeV,
    )
    stages = []
    for local in range(1 if single else 2):
        stage = mock.create_autospec(PipelineStage, instance=True)
        stage.group_rank, stage.group_size, stage.submod = 0, ranks, torch.nn.Linear(1, 1)
        stage.num_stages = ranks * (1 if single else 2)
        stage.stage_index = local if v_shape else local * ranks
        stages.append(stage)
    with mock.patch.object(
        torch_schedules._PipelineScheduleRuntime, "_prepare_schedule_with_comms"
    ):
        return schedule_class(stages[0] if single else stages, microbatches, loss_fn=lambda o, t: o)


TORCH_CLASSES = [
    torch_schedules.ScheduleGPipe,
    torch_schedules.Schedule1F1B,
    torch_schedules.ScheduleInterleaved1F1B,
    torch_schedules.ScheduleLoopedBFS,
    torch_schedules.ScheduleInterleavedZeroBubble,
    torch_schedules.ScheduleZBVZeroBubble,
    torch_schedules.ScheduleDualPipeV,
]


@pytest.mark.parametrize("schedule_class", TORCH_CLASSES, ids=lambda c: c.__name__)
def test_from_torch_reads_every_torch_schedule_class_and_back(schedule_class):
    """Over R = 2..8 and every m torch accepts up to 3R+3: ``from_torch`` gives cutpipe's schedule
    of the same name, and exporting it gives torch's order back (Schedule1F1B's last rank
    aside, whose listed forward ids torch 2.13 numbers from 1)."""
    compared = 0
    for ranks in range(2, 9):
        for m in range(1, 3 * ranks + 4):
            try:
                theirs = torch_schedule(schedule_class, ranks, m)
            except ValueError:
                continue
            schedule = from_torch(theirs)
            assert schedule == generate(schedule.name, ranks, m), (schedule_class, ranks, m)
            exported = to_torch_actions(schedule)
            for rank in range(ranks - (schedule_class is torch_schedules.Schedule1F1B)):
                listed = [a for a in theirs.pipeline_order[rank] if a and a.is_compute_op]
                assert exported[rank] == listed, (schedule_class, ranks, m, rank)
            compared += 1
    assert compared >= 63  # DualPipeV, which needs m >= 2R, accepts the fewest


def test_from_torch_refuses_what_is_not_a_schedule():
    with pytest.raises(TypeError, match="torch.distributed.pipelining schedule object"):
        from_torch(42)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_torch_runtime_trains_cutpipe_schedules_exactly(world, tmp_path):
    """torch 2.13's own runtime runs cutpipe's DualPipeV (from `cutpipe schedule --format csv`,
    loaded by torch's ``_load_csv``), ZB-V and a tuned memory-capped V (``to_torch``), and its
    gradients match the single-process reference."""
    import interop_workers

    from cutpipe.cli.main import main
    from cutpipe.launch import run
    from cutpipe.plan.search.tune import cost_aware
    from cutpipe.schedule.fileformat import save_schedule
    from cutpipe.sim import Costs, peak_activations

    m = {2: 4, 4: 10}[world]
    csv_path = tmp_path / "dualpipev.csv"
    command = ["schedule", "-s", "dualpipev", "-r", str(world), "-m", str(m)]
    assert main([*command, "--format", "csv", "-o", str(csv_path)]) == 0
    save_schedule(generate("zbv", world, m), tmp_path / "zbv.json")
    cap = 2 * world - 1  # below ZB-V's 2R: the tuned schedule holds fewer activations
    tuned = cost_aware("v", world, m, Costs(), cap, search_evaluations=200)
    assert max(peak_activations(tuned, Costs())) <= cap
    save_schedule(tuned, tmp_path / "tuned.json")
    cases = [
        ("csv", str(csv_path)),
        ("to_torch", str(tmp_path / "zbv.json")),
        ("to_torch", str(tmp_path / "tuned.json")),
    ]
    for results in run(interop_workers.torch_runs, world, (cases,), timeout=240):
        for result in results:
            assert result["grad_error"] <= 1e-6, result["case"]
            if result["loss"] is not None:
                assert result["loss"] == pytest.approx(result["expected"], rel=1e-6)


def test_to_torch_checks_the_stages_it_is_given():
    schedule = generate("zbv", 2, 4)
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.stage_index = 0, 2, 1
    with pytest.raises(ValueError, match=r"rank 0 runs stages \[0, 3\]"):
        to_torch(schedule, [stage])
    stage.stage_index, stage.group_size = 0, 4
    other = mock.create_autospec(PipelineStage, instance=True)
    other.group_rank, other.group_size, other.stage_index = 0, 4, 3
    with pytest.raises(ValueError, match="process group has 4"):
        to_torch(schedule, [stage, other])
    with pytest.raises(ValueError, match="cannot express"):
        to_torch(generate("dualpipe", 2, 4), [stage])
