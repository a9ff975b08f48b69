"""Stages balanced from costs measured on the machine (``cutpipe.train.balance``): the search is
the planner's on the measured figures, the figures are cached by what they depend on, a profile
of another model is refused, and a partition changes where the work runs, not what is learned."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cutpipe.plan.costs.model import gpu, p2p_time
from cutpipe.plan.costs.profile import Profile
from cutpipe.plan.partition import balance
from cutpipe.schedule.registry import generate
from cutpipe.spec import ModelSpec
from cutpipe.train import balance as balancing

ROOT = Path(__file__).parents[1]
TINY = ROOT / "examples" / "models" / "tiny-dense.yaml"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _profile(head_seconds: float) -> Profile:
    """A profile of tiny-dense whose layers take 1 ms each way and whose head takes
    ``head_seconds`` forward (and twice that back)."""
    spec = ModelSpec.load(TINY)
    items = {
        kind: replace(item, forward=seconds, backward=2 * seconds, weight=seconds)
        for kind, item, seconds in (
            ("embedding", _item("embedding"), 1e-4),
            ("dense_layer", _item("dense_layer"), 1e-3),
            ("head", _item("head"), head_seconds),
        )
    }
    return Profile(spec, "cpu", "fp32", items, 0.5)


def _item(kind: str):
    from cutpipe.plan.costs.model import ItemCost

    return ItemCost(kind, 0.0, 0.0, 0.0, activation=1e6, parameters=1e5)


@pytest.mark.parametrize("name", ["1f1b", "zbv", "dualpipev", "interleaved"])
def test_the_partition_is_the_planners_search_on_the_measured_costs(name):
    ranks = 2
    schedule = generate(name, ranks, 8)
    profile = _profile(head_seconds=4e-3)  # the head costs four layers
    chosen = balancing.balance_stages(schedule, profile, "a test")
    spec = profile.model
    items = profile.items_for(gpu("H100"))
    expected = balance(schedule, items, p2p_time(spec, gpu("H100"), True), profile.w_memory)
    assert list(chosen.sizes) == expected.sizes
    assert sum(chosen.sizes) == spec.layers + 2
    assert chosen.step_seconds == pytest.approx(expected.step_time)
    assert len(chosen.rank_seconds) == ranks and all(t > 0 for t in chosen.rank_seconds)


def test_a_dearer_head_moves_layers_off_the_last_stage():
    schedule = generate("1f1b", 2, 8)
    cheap = balancing.balance_stages(schedule, _profile(head_seconds=1e-4), "cheap")
    dear = balancing.balance_stages(schedule, _profile(head_seconds=6e-3), "dear")
    assert cheap.sizes == (5, 5)  # embedding + 4 layers, 4 layers + head
    assert dear.sizes[1] < cheap.sizes[1]


def test_measured_costs_are_cached_by_what_they_depend_on(monkeypatch, tmp_path):
    import cutpipe.profiling

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def fake_profile(spec, device, dtype, repeats, warmup):
        calls.append((spec.microbatch_size, dtype))
        return replace(_profile(1e-3), model=spec)

    monkeypatch.setattr(cutpipe.profiling, "profile_model", fake_profile)
    spec = ModelSpec.load(TINY)
    cpu = torch.device("cpu")
    first, said = balancing.measure(spec, cpu, "fp32")
    assert "measured on this machine now" in said and str(tmp_path) in said
    again, said = balancing.measure(spec, cpu, "fp32")
    assert "earlier" in said and again == first and len(calls) == 1
    balancing.measure(balancing.run_spec(spec, 2), cpu, "fp32")  # another microbatch
    balancing.measure(spec, cpu, "bf16")  # another precision
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        balancing.measure(spec, cpu, "fp32")  # other threads
    finally:
        torch.set_num_threads(threads)
    assert len(calls) == 4
    # a damaged entry is measured again
    for entry in (tmp_path / "cutpipe" / "costs").iterdir():
        entry.write_text("{")
    balancing.measure(spec, cpu, "fp32")
    assert len(calls) == 5


def test_a_profile_of_another_model_is_refused_by_name():
    spec = ModelSpec.load(TINY)
    profile = _profile(1e-3)
    balancing.check_profile(profile, spec, "p.json")  # the same model
    with pytest.raises(ValueError, match=r"--profile p.json .*microbatch_size 8 vs 4"):
        balancing.check_profile(profile, balancing.run_spec(spec, 8), "p.json")


def _train(tmp_path: Path, name: str, *extra: str) -> tuple[subprocess.CompletedProcess, list]:
    metrics = tmp_path / f"{name}.jsonl"
    command = [sys.executable, "-m", "cutpipe", "train", "--nproc", "2", "-s", "1f1b",
               "--model", str(TINY), "--seq-len", "32", "-m", "8", "--steps", "2", "--quiet",
               "--metrics", str(metrics), *extra]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, env=ENV, capture_output=True, text=True,
                          timeout=240)  # fmt: skip
    records = (
        [json.loads(line) for line in metrics.read_text().splitlines()]
        if done.returncode == 0
        else []
    )
    return done, records


@pytest.mark.timeout(600)
def test_a_run_balanced_from_a_profile_learns_what_the_nominal_partition_learns(tmp_path):
    """A profile whose head costs six layers moves layers off the last stage; the losses are
    those of the planner's partition, and the log's first record says which ran and why."""
    spec = balancing.run_spec(replace(ModelSpec.load(TINY), seq_len=32), 4)
    profile = replace(_profile(head_seconds=6e-3), model=spec)
    profile.save(tmp_path / "profile.json")
    nominal, plain = _train(tmp_path, "nominal", "--balance", "nominal")
    assert nominal.returncode == 0, nominal.stderr
    skewed, moved = _train(tmp_path, "profiled", "--profile", "profile.json", "--trace", "t.json")
    assert skewed.returncode == 0, skewed.stderr
    # the last step beside the simulator fed its measured op durations
    assert "simulated from its op times" in skewed.stdout
    for record in moved:  # where each step's time went
        parts = record["outside_ms"]
        assert set(parts) == {"data", "loss", "timeline", "clip", "optimizer", "routing"}
        timed = record["pipeline_ms"] + sum(parts.values())
        assert 0.5 * record["step_time"] * 1e3 < timed <= record["step_time"] * 1e3
        # its replay waits for nothing but the ops: no longer than the pipeline step measured
        assert 0 < record["replay_ms"] <= 1.1 * record["pipeline_ms"]
    assert plain[0]["run"]["stage_sizes"] == [5, 5] and "balance" not in plain[0]["run"]
    run = moved[0]["run"]
    expected = balancing.balance_stages(generate("1f1b", 2, 8), profile, "x").sizes
    assert run["stage_sizes"] == list(expected) and expected[1] < 5
    assert run["balance"]["source"] == "--profile profile.json"
    for a, b in zip(plain, moved, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)

    other = replace(profile, model=replace(spec, hidden=32))
    other.save(tmp_path / "other.json")
    refused, _ = _train(tmp_path, "other", "--profile", "other.json")
    assert refused.returncode == 2, refused.stderr
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert (
        len(lines) == 1 and "measured another model" in lines[0] and "hidden 64 vs 32" in lines[0]
    )


def test_profile_and_a_fixed_partition_are_refused_together(tmp_path):
    command = [sys.executable, "-m", "cutpipe", "train", "-s", "1f1b", "--model", str(TINY),
               "--balance", "nominal", "--profile", str(TINY)]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, env=ENV, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 2
    assert "--profile balances the stages from its costs" in done.stderr
