"""Checkpoints (cutpipe.train.checkpoint): saved by one layout, loaded bitwise by any other;
complete or invisible after a crash; the unsplit model exported to .pt and .safetensors."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import checkpoint_workers as workers
import pytest
import torch

from cutpipe.launch import run, spawn
from cutpipe.train.checkpoint import (
    MARK,
    POINTER,
    Checkpointer,
    CheckpointError,
    export_checkpoint,
    latest_checkpoint,
    load,
    read_safetensors,
    save,
    step_folder,
    write_safetensors,
)
from cutpipe.train.checkpoint.agreement import SaveRequest, check_save_agreement
from cutpipe.train.checkpoint.errors import Failure
from cutpipe.train.checkpoint.folders import Manifest, write_mark

# a Checkpointer without a process group saves in DCP's writer thread, which warns that it
# assumes a single process: that is the intent here
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def union(folder: Path, ranks: int) -> dict:
    """The snapshots of ``ranks`` ranks merged by FQN; copies held twice must agree bitwise."""
    merged: dict = {"model": {}, "optim": {}, "groups": {}, "scheduler": []}
    for rank in range(ranks):
        part = torch.load(folder / f"rank{rank}.pt", weights_only=False)
        for kind in ("model", "optim", "groups"):
            for name, value in part[kind].items():
                if name in merged[kind]:
                    assert_same(merged[kind][name], value, f"{kind} {name} (a duplicated copy)")
                merged[kind][name] = value
        merged["scheduler"].append(part["scheduler"])
    return merged


def assert_same(expected, actual, what: str) -> None:
    """Equal bitwise: tensors by ``torch.equal`` with dtype and shape, the rest by ``==``."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), what
        assert expected.dtype == actual.dtype and expected.shape == actual.shape, what
        assert torch.equal(expected, actual), what
    elif isinstance(expected, dict):
        assert expected.keys() == actual.keys(), what
        for key in expected:
            assert_same(expected[key], actual[key], f"{what}.{key}")
    else:
        assert expected == actual, what


def assert_loaded(truth: dict, loaded: dict, what: str) -> None:
    for kind in ("model", "optim", "groups"):
        assert truth[kind].keys() == loaded[kind].keys(), f"{what}: {kind} names"
        for name in truth[kind]:
            assert_same(truth[kind][name], loaded[kind][name], f"{what}: {kind} {name}")
    for scheduler in loaded["scheduler"]:
        assert scheduler == truth["scheduler"][0], what


def data_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.glob("*.distcp"))


@pytest.mark.timeout(300)
def test_a_dualpipe_checkpoint_loads_into_every_layout(tmp_path):
    directory, truth, out = tmp_path / "run", tmp_path / "truth", tmp_path / "other"
    truth.mkdir()
    out.mkdir()
    # saved, then loaded into another layout on as many ranks by the same processes (fresh
    # models of another seed: tests/test_train.py resumes it on DualPipeV's 2 ranks)
    arguments = (str(directory), str(truth), "other", str(out))
    results = run(workers.save_then_load, 4, arguments, timeout=200)
    saved = union(truth, 4)
    assert (directory / POINTER).read_text().strip() == "step-000003"
    assert latest_checkpoint(directory) == step_folder(directory, 3)

    assert_loaded(saved, union(out, 4), "other on 4 ranks")
    for result in results:
        assert result["step"] == 3 and result["extra"] == {"position": 3, "epoch": 0}
        assert not result["rng"]
        assert any("RNG states not restored" in note for note in result["notes"])
    # the same state saved without duplicates takes as many bytes
    dualpipe = data_bytes(step_folder(directory, 3))
    single = data_bytes(out / "again" / "step-000003")
    assert dualpipe <= 1.1 * single, (dualpipe, single)

    # one process, no process group: the whole model
    module, optimizer, scheduler = workers.build("all", 0, seed=2)
    restored = load(directory, module, optimizer, scheduler)
    assert restored.step == 3 and not restored.rng_restored
    alone = workers.snapshot(module, optimizer, scheduler)
    alone["scheduler"] = [alone["scheduler"]]
    assert_loaded(saved, alone, "one process")

    for ending in (".pt", ".safetensors"):
        output = export_checkpoint(directory, tmp_path / f"model{ending}")
        exported = torch.load(output) if ending == ".pt" else read_safetensors(output)
        assert_same(saved["model"], exported, f"export {ending}")


@pytest.mark.timeout(200)
def test_a_resumed_run_continues_bitwise_like_an_uninterrupted_one(tmp_path):
    results = run(workers.resume, 2, (str(tmp_path),), timeout=150)
    for result in results:
        assert result["mismatched"] == []
        assert result["scheduler"] and result["rng"] and result["extra"] == {"position": 3}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("where", ["before-mark", "before-pointer", "rank-dies"])
def test_a_crash_while_saving_leaves_latest_at_the_previous_checkpoint(tmp_path, where):
    outcomes = spawn(workers.crash, 2, (str(tmp_path), where), timeout=150, grace=20)
    victim = 1 if where == "rank-dies" else 0
    assert outcomes[victim].exitcode == 3, outcomes[victim]  # died where the test said
    assert not outcomes[1 - victim].ok  # its peer noticed
    crashed = step_folder(tmp_path, 4)
    if where != "rank-dies":  # every rank's part and DCP's index were written
        assert (crashed / ".metadata").exists()
        assert (crashed / MARK).exists() == (where == "before-pointer")
    assert (tmp_path / POINTER).read_text().strip() == "step-000002"
    assert latest_checkpoint(tmp_path) == step_folder(tmp_path, 2)
    module, optimizer, scheduler = workers.build("all", 0, seed=3)
    assert load(tmp_path, module, optimizer, scheduler).extra == {"position": 2}
    # the next run saves step 4 again over whatever the crash left there
    save(tmp_path, 4, module, optimizer, scheduler, {"position": 4})
    assert latest_checkpoint(tmp_path) == step_folder(tmp_path, 4)


# -- one process -----------------------------------------------------------------------------------


def trained(seed: int = 0, steps: int = 2):
    workers.seed_everything(seed)
    module, optimizer, scheduler = workers.build("all", 0, seed=seed)
    workers.train(module, optimizer, scheduler, range(steps))
    return module, optimizer, scheduler


def test_a_folder_without_the_mark_is_never_the_latest(tmp_path):
    module, optimizer, scheduler = trained()
    save(tmp_path, 2, module, optimizer, scheduler)
    half = step_folder(tmp_path, 5)
    half.mkdir()
    (half / "__0_0.distcp").write_bytes(b"half written")
    assert latest_checkpoint(tmp_path) == step_folder(tmp_path, 2)
    (tmp_path / POINTER).write_text("step-000005\n")  # a pointer to it: fall back to a complete one
    assert latest_checkpoint(tmp_path) == step_folder(tmp_path, 2)
    (tmp_path / POINTER).write_text("garbage")
    assert latest_checkpoint(tmp_path) == step_folder(tmp_path, 2)
    with pytest.raises(FileNotFoundError, match="is not a complete checkpoint"):
        load(half, module, optimizer, scheduler)
    assert latest_checkpoint(tmp_path / "nothing") is None


class Watching(Checkpointer):
    """Records which step folders exist when ``latest`` is about to move."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[list[str]] = []

    def _point(self, folder) -> None:
        self.seen.append(sorted(p.name for p in self.directory.glob("step-*")))
        super()._point(folder)


def test_keep_deletes_old_checkpoints_only_after_a_newer_one_is_complete(tmp_path):
    module, optimizer, scheduler = trained()
    with Watching(tmp_path, keep=2) as checkpoints:
        for step in (1, 2):
            checkpoints.save(step, module, optimizer, scheduler)
        leftover = step_folder(tmp_path, 3)  # a crashed save
        leftover.mkdir()
        checkpoints.save(4, module, optimizer, scheduler)
        checkpoints.wait()
        assert checkpoints.seen[-1] == ["step-000001", "step-000002", "step-000003", "step-000004"]
        assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000002", "step-000004"]
        later = step_folder(tmp_path, 9)  # from a run that was resumed at an earlier step
        later.mkdir()
        checkpoints.save(5, module, optimizer, scheduler)
        checkpoints.save(6, module, optimizer, scheduler)
    names = sorted(p.name for p in tmp_path.glob("step-*"))
    assert names == ["step-000005", "step-000006", "step-000009"]  # the later one is left alone
    assert latest_checkpoint(tmp_path) == step_folder(tmp_path, 6)
    assert all((step_folder(tmp_path, s) / MARK).exists() for s in (5, 6))


def test_the_checkpointer_resumes_from_the_latest_and_restores_every_generator(tmp_path):
    module, optimizer, scheduler = trained()
    with Checkpointer(tmp_path) as checkpoints:
        assert checkpoints.load_latest(module, optimizer, scheduler) is None  # nothing yet
        checkpoints.save(2, module, optimizer, scheduler, {"position": 2})
    expected = (torch.rand(3), torch.randn(2), random.random())
    workers.seed_everything(7)
    module, optimizer, scheduler = workers.build("all", 0, seed=7)
    with Checkpointer(tmp_path) as checkpoints:
        assert checkpoints.load_latest(module, optimizer, scheduler) == {"position": 2}
    again = (torch.rand(3), torch.randn(2), random.random())
    assert torch.equal(expected[0], again[0]) and torch.equal(expected[1], again[1])
    assert expected[2] == again[2]


def test_a_fresh_optimizer_stays_fresh_through_a_checkpoint(tmp_path):
    module, optimizer, scheduler = trained(steps=0)
    before = workers.snapshot(module, optimizer, scheduler)
    save(tmp_path, 0, module, optimizer, scheduler)
    assert not optimizer.state  # saving took no step
    assert_same(before["model"], workers.snapshot(module, optimizer, scheduler)["model"], "model")
    other, other_optimizer, other_scheduler = workers.build("all", 0, seed=4)
    load(tmp_path, other, other_optimizer, other_scheduler)
    assert not other_optimizer.state
    assert_same(
        before["model"], workers.snapshot(other, other_optimizer, other_scheduler)["model"], "model"
    )


def test_export_writes_the_unsplit_state_dict(tmp_path):
    full = workers.full_model(0)
    module = workers.holding(full, workers.ALL)
    save(tmp_path / "run", 1, module)
    for ending in (".pt", ".safetensors"):
        output = export_checkpoint(tmp_path / "run" / "step-000001", tmp_path / f"model{ending}")
        exported = torch.load(output) if ending == ".pt" else read_safetensors(output)
        assert_same(full.state_dict(), exported, ending)
        workers.full_model(5).load_state_dict(exported)  # loads into the unsplit model
    with pytest.raises(ValueError, match="use one of .pt, .safetensors"):
        export_checkpoint(tmp_path / "run", tmp_path / "model.bin")


def test_safetensors_round_trip_every_dtype(tmp_path):
    tensors = {
        "f32": torch.randn(3, 4),
        "bf16": torch.randn(5).to(torch.bfloat16),
        "f16": torch.randn(2, 1, 3).to(torch.float16),
        "f64": torch.tensor(2.5, dtype=torch.float64),
        "i64": torch.arange(7),
        "u8": torch.arange(3, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 3),
        "strided": torch.randn(4, 6)[:, ::2],
    }
    path = write_safetensors(tensors, tmp_path / "t.safetensors")
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    assert header["bf16"] == {
        "dtype": "BF16",
        "shape": [5],
        "data_offsets": header["bf16"]["data_offsets"],
    }
    assert (8 + length) % 8 == 0
    back = read_safetensors(path)
    assert list(back) == list(tensors)
    for name, tensor in tensors.items():
        assert_same(tensor.contiguous(), back[name], name)
    safetensors = pytest.importorskip("safetensors.torch")
    for name, tensor in safetensors.load_file(str(path)).items():
        assert_same(tensors[name].contiguous(), tensor, f"safetensors package: {name}")


def test_load_names_what_is_missing_and_what_is_unexpected(tmp_path):
    full = workers.full_model(0)
    save(tmp_path, 1, workers.holding(full, workers.ALL[:5]))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load(tmp_path / "absent", full)
    with pytest.raises(FileNotFoundError, match="holds no complete checkpoint"):
        (tmp_path / "empty").mkdir()
        load(tmp_path / "empty", full)
    part = workers.holding(workers.full_model(1), workers.ALL[3:7])
    with pytest.raises(ValueError) as error:
        load(tmp_path, part)
    message = str(error.value)
    assert "rank 0 holds layers.4.down.bias" in message and "which the checkpoint lacks" in message
    assert "the checkpoint holds embed.bias" in message and "which no rank holds" in message
    assert "allow_partial=True" in message
    restored = load(tmp_path, part, allow_partial=True)
    assert any("loaded partially" in note for note in restored.notes)
    assert torch.equal(part.get_parameter("layers.2.up.weight"), full.layers[2].up.weight)
    with pytest.raises(ValueError, match="holds no optimizer state"):
        whole = workers.holding(full, workers.ALL[:5])
        load(tmp_path, whole, torch.optim.AdamW(whole.parameters()))


def test_bad_arguments_say_what_to_change(tmp_path):
    module = trained()[0]
    with pytest.raises(ValueError, match="keep must be a whole number >= 1"):
        Checkpointer(tmp_path, keep=0)
    with pytest.raises(ValueError, match="extra must hold JSON values"):
        save(tmp_path, 1, module, extra={"generator": torch.zeros(2)})
    with pytest.raises(ValueError, match="step must be a whole number >= 0"):
        save(tmp_path, -1, module)
    save(tmp_path, 1, module)
    with pytest.raises(CheckpointError, match="is the latest complete checkpoint"):
        save(tmp_path, 1, module)
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError, match="is a file"):
        Checkpointer(tmp_path / "file")
    assert not os.path.exists(tmp_path / "step-000000")


def test_every_rank_raises_the_same_error_from_what_the_ranks_sent():
    """The records ranks gather before a save, checked as every rank checks them (no processes
    needed: each rank runs the same function on the same list)."""
    good = SaveRequest(step=4, extra='{"position": 4}', layout="abc")
    check_save_agreement([good, good])
    mistaken = SaveRequest(0, "{}", "abc", mistake=Failure.of(TypeError("extra must be a dict")))
    with pytest.raises(ValueError, match="^rank 1 cannot save: extra must be a dict$"):
        check_save_agreement([good, mistaken])
    refused = SaveRequest(4, "{}", "abc", refusal=Failure.of(CheckpointError("cannot write")))
    with pytest.raises(CheckpointError, match="^cannot write$"):
        check_save_agreement([refused, good])
    with pytest.raises(CheckpointError, match=r"different steps \(rank 0 step 4, rank 1 step 5\)"):
        check_save_agreement([good, SaveRequest(5, good.extra, "abc")])
    with pytest.raises(CheckpointError, match="extra differs between rank 0 and ranks 1, 2"):
        other = SaveRequest(4, "{}", "abc")
        check_save_agreement([good, other, other])
    # an error found on one rank becomes an exception of its own class (where that is expected)
    failure = Failure.of(NotADirectoryError("a file"))
    assert str(failure) == "NotADirectoryError: a file"
    raised = failure.exception(NotADirectoryError, otherwise=FileNotFoundError)
    assert type(raised) is NotADirectoryError and str(raised) == "a file"
    unexpected = Failure.of(PermissionError("denied")).exception(otherwise=FileNotFoundError)
    assert type(unexpected) is FileNotFoundError and str(unexpected) == "denied"


def test_the_completion_mark_is_written_and_read_as_before(tmp_path):
    manifest = Manifest(step=3, world_size=2, layouts=("a", "b"))
    write_mark(tmp_path, manifest)
    assert json.loads((tmp_path / MARK).read_text()) == {
        "format": "cutpipe-checkpoint/1",
        "step": 3,
        "world_size": 2,
        "layouts": ["a", "b"],
    }
    assert Manifest.read(tmp_path) == manifest
    assert manifest.saved_by(["a", "b"]) and not manifest.saved_by(["b", "a"])
    (tmp_path / MARK).write_text('{"format": "cutpipe-checkpoint/1"}')
    assert Manifest.read(tmp_path) == Manifest(step=0, world_size=None, layouts=None)


@pytest.mark.timeout(300)
def test_async_save_stalls_the_loop_less_than_a_synchronous_save(tmp_path):
    """Prints the measured stall (``pytest tests/test_checkpoint.py -k stall -s``); asserts no
    timing, only that both ran."""
    results = run(workers.stall, 4, (str(tmp_path), 256, 3), timeout=250)
    asynchronous = max(r["async"] for r in results)
    synchronous = max(r["sync"] for r in results)
    state = sum(r["bytes"] for r in results) / 2  # every stage is held twice
    print(
        f"\n4-rank DualPipe layout, {state / 2**20:.1f} MiB of parameters and AdamW state: save() "
        f"blocks {asynchronous * 1e3:.1f} ms asynchronous, {synchronous * 1e3:.1f} ms synchronous "
        f"(slowest rank, median of 3)"
    )
    assert asynchronous > 0 and synchronous > 0
