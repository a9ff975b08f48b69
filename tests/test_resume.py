"""A resumed run against its checkpoint's record (cutpipe.train.resume): what defines the run is
refused with both values, what may change is applied and named, and a changed learning-rate
schedule is the new one from the step reached."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cutpipe.train.optim import decay_groups, warmup_cosine
from cutpipe.train.options import TrainOptions
from cutpipe.train.resume import apply_schedule, differences

SAVED = {
    "model": {"layers": 8, "hidden": 64}, "data": [], "seq_len": 128, "seed": 0, "batch": 32,
    "grad_accum": 1, "lr": 0.003, "warmup": 1, "min_lr_ratio": 0.1, "steps": 10,
    "weight_decay": 0.1, "clip": 1.0, "schedule": "zbv", "microbatches": 8, "dp": 1,
    "dp_mode": "allreduce", "dtype": "fp32", "recompute": "none", "step_boundary": "sync",
}  # fmt: skip


def test_the_same_options_change_nothing():
    found = differences(SAVED, dict(SAVED))
    assert not found.changed and not found.refused and not found.reschedules
    found.check(3)
    assert found.line() is None


def test_what_may_change_is_applied_and_named():
    found = differences(SAVED, {**SAVED, "lr": 0.001, "steps": 20, "schedule": "dualpipev"})
    assert set(found.changed) == {"lr", "steps", "schedule"} and found.reschedules
    found.check(3)
    assert found.line() == (
        "the resumed run changes lr 0.003 -> 0.001, steps 10 -> 20, schedule zbv -> dualpipev "
        "(the learning rate follows the new schedule from this step)"
    )


def test_what_defines_the_run_is_refused_with_both_values():
    now = {**SAVED, "model": {"layers": 4, "hidden": 64}, "seq_len": 64, "lr": 0.1}
    found = differences(SAVED, now)
    assert set(found.refused) == {"model", "seq_len"}
    with pytest.raises(ValueError, match=r"another run \(model \{layers: 8\} -> \{layers: 4\}; "
                                         r"seq_len 128 -> 64\)"):  # fmt: skip
        found.check(3)


def test_a_checkpoint_without_a_record_is_compared_on_nothing():
    found = differences(None, SAVED)
    found.check(3)
    assert "records no options" in found.line()


def test_the_new_schedule_is_the_one_a_fresh_run_would_be_at():
    """After 3 steps of lr 0.003 over 10 steps, resumed with lr 0.001 over 20 and less decay:
    every group's rate is what a run with the new options has after 3 steps."""
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))

    def build(lr: float, steps: int, decay: float):
        optimizer = torch.optim.AdamW(decay_groups(model, decay), lr=lr)
        return optimizer, warmup_cosine(optimizer, 1, steps, 0.1)

    optimizer, scheduler = build(0.003, 10, 0.1)
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    saved = optimizer.state_dict(), scheduler.state_dict()
    resumed, resumed_scheduler = build(0.003, 10, 0.1)
    resumed.load_state_dict(saved[0])
    resumed_scheduler.load_state_dict(saved[1])
    options = TrainOptions.build(lr=0.001, steps=20, warmup=1, weight_decay=0.05)
    apply_schedule(resumed, resumed_scheduler, options)
    fresh, fresh_scheduler = build(0.001, 20, 0.05)
    for _ in range(3):
        fresh.step()
        fresh_scheduler.step()
    for _ in range(2):  # and it goes on the same way
        assert [g["lr"] for g in resumed.param_groups] == [g["lr"] for g in fresh.param_groups]
        assert [g["weight_decay"] for g in resumed.param_groups] == [0.05, 0.0]
        resumed_scheduler.step()
        fresh_scheduler.step()
