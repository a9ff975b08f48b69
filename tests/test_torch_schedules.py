"""Every schedule PyTorch 2.13 ships is in cutpipe: GPipe and the looped ones (several stages per
rank, rank r holding stages r, r+R, ...) equal torch's order op for op in every shape torch
accepts with R = 1..8, m = 1..3R+3 and 1 to 4 chunks; 1F1B does once torch's last rank is
corrected; torch's class names name them. (The V schedules: ``test_torch_interop.py``.)

Torch's orders come from mocked stages, without a process group; torch's lowering into sends and
receives is skipped here (it does not change the compute order, and
``test_torch_interop.py`` lowers every cutpipe schedule through it).
"""

from unittest import mock

import pytest
import torch
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining.stage import PipelineStage

from cutpipe.interop.torch_pipelining import from_torch_actions
from cutpipe.schedule import SCHEDULES, Placement, generate, schedule_info

SHAPES = [(r, m) for r in range(1, 9) for m in range(1, 3 * r + 4)]  # 132 shapes


def looped_stages(chunks: int) -> list:
    """Rank 0's stages of a looped placement; torch derives every rank's order from them."""
    stages = [mock.create_autospec(PipelineStage, instance=True) for _ in range(chunks)]
    for stage in stages:
        stage.group_rank, stage.submod = 0, torch.nn.Linear(1, 1)
    return stages


def looped_order(schedule_class, stages: list, ranks: int, microbatches: int) -> dict:
    for local, stage in enumerate(stages):
        stage.group_size, stage.num_stages = ranks, len(stages) * ranks
        stage.stage_index = local * ranks
    with mock.patch.object(schedule_class, "_prepare_schedule_with_comms"):
        schedule = schedule_class(stages, microbatches, loss_fn=lambda out, target: out)
    return schedule.pipeline_order


def rounds_are_even(ranks: int, m: int) -> bool:
    """Torch's interleaved schedules need m to be a multiple of max(1, m // R)."""
    return m % max(1, m // ranks) == 0


@pytest.mark.parametrize("chunks", [1, 2, 3, 4])
@pytest.mark.parametrize(
    ("name", "schedule_class", "accepted"),
    [
        ("loopedbfs", torch_schedules.ScheduleLoopedBFS, 132),
        ("interleaved", torch_schedules.ScheduleInterleaved1F1B, 102),
        ("interleavedzb", torch_schedules.ScheduleInterleavedZeroBubble, 102),
    ],
)
def test_looped_schedules_match_torch_op_for_op(name, schedule_class, accepted, chunks):
    stages = looped_stages(chunks)
    compared = 0
    for ranks, m in SHAPES:
        try:
            order = looped_order(schedule_class, stages, ranks, m)
        except ValueError:  # torch's interleaved schedules need even rounds; ours do not
            assert name != "loopedbfs" and not rounds_are_even(ranks, m)
            continue
        theirs = from_torch_actions(name, Placement.interleaved(ranks, chunks), m, order)
        assert generate(name, ranks, m, chunks=chunks) == theirs, f"{name} R={ranks} m={m}"
        compared += 1
    assert compared == accepted


def single_order(schedule_class, stage, ranks: int, microbatches: int) -> dict:
    stage.group_rank, stage.group_size, stage.num_stages, stage.stage_index = 0, ranks, ranks, 0
    return schedule_class(stage, microbatches, loss_fn=lambda out, target: out).pipeline_order


def test_gpipe_matches_torch_op_for_op():
    stage = looped_stages(1)[0]
    for ranks, m in SHAPES:
        order = single_order(torch_schedules.ScheduleGPipe, stage, ranks, m)
        theirs = from_torch_actions("gpipe", Placement.linear(ranks), m, order)
        assert generate("gpipe", ranks, m) == theirs, f"R={ranks} m={m}"


def test_torch_1f1b_is_ours_but_for_its_last_ranks_forward_ids():
    """Torch's Schedule1F1B order numbers its last rank's forwards 1..m (m does not exist), so
    it is not used; shifted down by one it is ours, in all 104 shapes torch accepts (m >= R)."""
    stage, compared = looped_stages(1)[0], 0
    for ranks, m in SHAPES:
        try:
            order = single_order(torch_schedules.Schedule1F1B, stage, ranks, m)
        except ValueError:
            assert m < ranks
            continue
        forward = torch_schedules._ComputationType.FORWARD
        last = [
            a._replace(microbatch_index=a.microbatch_index - 1)
            if a.computation_type == forward
            else a
            for a in order[ranks - 1]
            if a is not None
        ]
        theirs = from_torch_actions("1f1b", Placement.linear(ranks), m, {**order, ranks - 1: last})
        assert generate("1f1b", ranks, m) == theirs, f"R={ranks} m={m}"
        compared += 1
    assert compared == 104


TORCH_NAMES = {
    "GPipe": "gpipe",
    "1F1B": "1f1b",
    "Interleaved1F1B": "interleaved",
    "LoopedBFS": "loopedbfs",
    "InterleavedZeroBubble": "interleavedzb",
    "ZBVZeroBubble": "zbv",
    "DualPipeV": "dualpipev",
}


@pytest.mark.parametrize(("torch_name", "name"), TORCH_NAMES.items())
def test_torch_class_names_are_aliases_in_any_case_with_or_without_the_prefix(torch_name, name):
    for spelling in (torch_name, f"Schedule{torch_name}", torch_name.lower(), torch_name.upper()):
        assert schedule_info(spelling).name == name
        assert generate(spelling, 2, 4).name == name
    assert torch_schedules.get_schedule_class(torch_name).__name__ == f"Schedule{torch_name}"


def test_every_training_schedule_torch_ships_has_a_cutpipe_name():
    shipped = [
        name
        for name, value in vars(torch_schedules).items()
        if name.startswith("Schedule")
        and isinstance(value, type)
        and issubclass(value, torch_schedules._PipelineSchedule)
    ]
    assert sorted(shipped) == sorted(f"Schedule{name}" for name in TORCH_NAMES)
    for name in shipped:
        assert schedule_info(name).name in SCHEDULES


def test_an_alias_takes_parameters_and_unknown_names_list_the_known_ones():
    assert generate("Interleaved1F1B:chunks=3", 4, 8) == generate("interleaved", 4, 8, chunks=3)
    with pytest.raises(ValueError, match="known schedules: gpipe, 1f1b, .*ZBVZeroBubble"):
        schedule_info("ScheduleZBH3")
