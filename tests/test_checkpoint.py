"""Checkpoints (cutpipe.train.checkpoint): saved by one layout, loaded bitwise by any other;
complete or invisible after a crash; the unsplit model exported to .pt and .safetensors."""

from __future__ import annotations

import errno
import json
import os
import random
from dataclasses import replace
from pathlib import Path

import checkpoint_workers as workers
import pytest
import torch

from cutpipe.cli.main import main as cli
from cutpipe.launch import run, spawn
from cutpipe.train.checkpoint import (
    FRESH,
    IF_PRESENT,
    MARK,
    OVERWRITE,
    POINTER,
    RESUME,
    Checkpointer,
    CheckpointError,
    check_directory,
    export_checkpoint,
    find_latest,
    latest_checkpoint,
    load,
    read_metadata,
    read_safetensors,
    save,
    step_folder,
    write_safetensors,
)
from cutpipe.train.checkpoint.agreement import SaveRequest, check_save_agreement
from cutpipe.train.checkpoint.errors import Failure
from cutpipe.train.checkpoint.folders import RUN, FileRecord, Manifest, write_mark
from cutpipe.train.options import TrainOptions

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


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """The 4-rank checks of this module from one launch: a folder holding ``run`` (DualPipe's
    checkpoints), ``truth`` (what each rank saved) and ``other`` (what each rank loaded into
    another layout); each rank's results."""
    folder = tmp_path_factory.mktemp("four")
    for name in ("truth", "other"):
        (folder / name).mkdir()
    saved = (str(folder / "run"), str(folder / "truth"), "other", str(folder / "other"))
    stalled = (str(folder / "stall"), 256, 3)
    return folder, run(workers.four_ranks, 4, (saved, stalled), timeout=400)


@pytest.mark.timeout(500)
def test_a_dualpipe_checkpoint_loads_into_every_layout(four_ranks, tmp_path):
    # saved, then loaded into another layout on as many ranks by the same processes (fresh
    # models of another seed: tests/test_train.py resumes it on DualPipeV's 2 ranks)
    folder, ranks = four_ranks
    directory, truth, out = folder / "run", folder / "truth", folder / "other"
    results = [rank["loaded"] for rank in ranks]
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
        leftover = step_folder(tmp_path, 3)  # a crashed save of another run: never deleted
        leftover.mkdir()
        checkpoints.save(4, module, optimizer, scheduler)
        checkpoints.wait()
        assert checkpoints.seen[-1] == ["step-000001", "step-000002", "step-000003", "step-000004"]
        names = sorted(p.name for p in tmp_path.glob("step-*"))
        assert names == ["step-000002", "step-000003", "step-000004"]
        later = step_folder(tmp_path, 9)  # from a run that was resumed at an earlier step
        later.mkdir()
        checkpoints.save(5, module, optimizer, scheduler)
        checkpoints.save(6, module, optimizer, scheduler)
    names = sorted(p.name for p in tmp_path.glob("step-*"))
    assert names == ["step-000003", "step-000005", "step-000006", "step-000009"]  # left alone
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
    # each file's size and checksum, as a save records them
    files = {".metadata": FileRecord(10, "ab" * 32), "__0_0.distcp": FileRecord(7, "cd" * 32)}
    write_mark(tmp_path, replace(manifest, files=files))
    assert json.loads((tmp_path / MARK).read_text())["files"]["__0_0.distcp"] == {
        "size": 7,
        "sha256": "cd" * 32,
    }
    assert Manifest.read(tmp_path).files == files
    (tmp_path / MARK).write_text('{"format": "cutpipe-checkpoint/1", "files": {"a": 3}}')
    with pytest.raises(CheckpointError, match="the files list of its complete.json cannot be read"):
        Manifest.read(tmp_path)


@pytest.mark.timeout(500)
def test_async_save_stalls_the_loop_less_than_a_synchronous_save(four_ranks):
    """Prints the measured stall (``pytest tests/test_checkpoint.py -k stall -s``); asserts no
    timing, only that both ran."""
    results = [rank["stall"] for rank in four_ranks[1]]
    asynchronous = max(r["async"] for r in results)
    synchronous = max(r["sync"] for r in results)
    state = sum(r["bytes"] for r in results) / 2  # every stage is held twice
    print(
        f"\n4-rank DualPipe layout, {state / 2**20:.1f} MiB of parameters and AdamW state: save() "
        f"blocks {asynchronous * 1e3:.1f} ms asynchronous, {synchronous * 1e3:.1f} ms synchronous "
        f"(slowest rank, median of 3)"
    )
    assert asynchronous > 0 and synchronous > 0


# -- the contract: never lose or hide a run, verify what is read -----------------------------------


def listing(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` with its bytes, by relative path."""
    return {
        str(path.relative_to(directory)): path.read_bytes()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def two_checkpoints(directory: Path, steps=(3, 6), **model):
    """An earlier run's checkpoints in ``directory``; the module they hold."""
    module = workers.holding(workers.full_model(0, **model), workers.ALL)
    for step in steps:
        save(directory, step, module, extra={"position": step})
    return module


def test_a_new_run_is_refused_where_checkpoints_are(tmp_path):
    module = two_checkpoints(tmp_path / "run")
    before = listing(tmp_path / "run")
    refused = r"already holds checkpoints \(the latest complete is step-000006\): pass --resume"
    with pytest.raises(ValueError, match=refused):
        check_directory(tmp_path / "run", FRESH)
    with pytest.raises(ValueError, match=refused), Checkpointer(tmp_path / "run") as checkpoints:
        checkpoints.start(FRESH, module)
    assert listing(tmp_path / "run") == before  # nothing moved, deleted or overwritten
    assert check_directory(tmp_path / "run", RESUME) == "step-000006"
    assert check_directory(tmp_path / "run", IF_PRESENT) == "step-000006"
    assert check_directory(tmp_path / "run", OVERWRITE) is None
    step_folder(tmp_path / "half", 2).mkdir(parents=True)  # an unfinished save only
    with pytest.raises(ValueError, match=r"holds checkpoints \(none of them complete\)"):
        check_directory(tmp_path / "half", FRESH)
    assert check_directory(tmp_path / "new" / "deeper", FRESH) is None  # made when saving
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is a file; give a folder"):
        check_directory(tmp_path / "file" / "run", FRESH)
    with pytest.raises(ValueError, match="resume must be one of"):
        check_directory(tmp_path / "run", "yes")


def test_overwrite_moves_the_earlier_run_aside_and_deletes_nothing(tmp_path):
    directory = tmp_path / "run"
    module = two_checkpoints(directory)
    before = listing(directory)
    said: list[str] = []
    with Checkpointer(directory, keep=1, say=said.append) as checkpoints:
        assert checkpoints.start(OVERWRITE, module) is None  # a new run: nothing resumed
        (aside,) = directory.glob("replaced-*")
        assert said == [
            f"--overwrite: moved the checkpoints in {directory} aside to {aside} (kept: delete "
            "that folder when they are no longer needed)"
        ]
        assert not (directory / POINTER).exists() and not list(directory.glob("step-*"))
        for step in (3, 6, 9):  # the new run's, over the old run's step names; keep=1 prunes
            checkpoints.save(step, module, extra={"position": -step})
    assert listing(aside) == before  # the old run, byte for byte
    assert sorted(p.name for p in directory.glob("step-*")) == ["step-000009"]
    assert latest_checkpoint(directory) == step_folder(directory, 9)


def test_resume_needs_a_complete_checkpoint_and_resume_if_present_starts_without(tmp_path):
    module = trained()[0]
    absent = tmp_path / "absent"
    with pytest.raises(ValueError, match="does not exist, so there is nothing to resume"):
        check_directory(absent, RESUME)
    with pytest.raises(ValueError, match="nothing to resume"), Checkpointer(absent) as checkpoints:
        checkpoints.start(RESUME, module)
    with Checkpointer(absent) as checkpoints:
        assert checkpoints.start(IF_PRESENT, module) is None
    # an unfinished save of another run: no resume from it, and never deleted
    directory = tmp_path / "run"
    unfinished = step_folder(directory, 2)
    unfinished.mkdir(parents=True)
    (unfinished / "__0_0.distcp").write_bytes(b"another run's bytes")
    with pytest.raises(ValueError, match="holds no complete checkpoint"):
        check_directory(directory, RESUME)
    said: list[str] = []
    with Checkpointer(directory, say=said.append) as checkpoints:
        assert checkpoints.start(IF_PRESENT, module) is None
        checkpoints.save(2, module)
    (aside,) = directory.glob("replaced-*")
    assert said == [f"moved the unfinished {unfinished} aside to {aside}: this run saves that step"]
    assert listing(aside) == {"step-000002/__0_0.distcp": b"another run's bytes"}
    assert latest_checkpoint(directory) == unfinished


def test_a_broken_latest_falls_back_to_the_newest_complete_step_with_a_note(tmp_path):
    module = two_checkpoints(tmp_path, steps=(2, 4))
    step_folder(tmp_path, 5).mkdir()  # unfinished
    pointer = tmp_path / POINTER
    for text, why in [
        ("garbage\x00", "does not name a step folder ('garbage\\x00')"),
        ("step-000009", "names step-000009, which does not exist"),
        ("step-000005", "names step-000005, which is not complete (no complete.json)"),
    ]:
        pointer.write_text(text)
        found = find_latest(tmp_path)
        assert found.folder == step_folder(tmp_path, 4)
        assert found.note == f"{pointer} {why}: using step-000004, the newest complete one"
    pointer.unlink()
    assert find_latest(tmp_path).note.endswith(
        "latest is missing: using step-000004, the newest complete one"
    )
    pointer.write_text("garbage")
    said: list[str] = []
    with Checkpointer(tmp_path, say=said.append) as checkpoints:
        restored = checkpoints.start(RESUME, module)
    assert restored.step == 4 and restored.extra == {"position": 4}
    assert said[0].startswith(f"{pointer} does not name a step folder ('garbage')")
    assert said[-1] == f"resumed from {step_folder(tmp_path, 4)} (after step 4)"


def zero_inside_a_weight(folder: Path) -> str:
    """Zero 8 KiB in the middle of one weight's bytes; the file's name."""
    storage = read_metadata(folder).storage_data
    (where,) = [info for index, info in storage.items() if index.fqn == "model.layers.3.up.weight"]
    assert where.length > 3 * 8192  # the weight is larger than what is zeroed
    with open(folder / where.relative_path, "r+b") as file:
        file.seek(where.offset + where.length // 2 - 4096)
        file.write(bytes(8192))
    return where.relative_path


def truncate(folder: Path) -> str:
    (shard,) = folder.glob("*.distcp")
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return shard.name


@pytest.mark.parametrize("damage", [zero_inside_a_weight, truncate])
def test_a_damaged_checkpoint_is_found_on_load_and_on_export(tmp_path, damage, capsys):
    big = dict(width=64, hidden=128)  # 32 KiB weights
    module = two_checkpoints(tmp_path, steps=(2, 4), **big)
    newest = step_folder(tmp_path, 4)
    name = damage(newest)
    other = workers.holding(workers.full_model(1, **big), workers.ALL)
    problem = "does not match the SHA-256" if damage is zero_inside_a_weight else "(truncated)"
    with pytest.raises(CheckpointError) as error:
        load(tmp_path, other)
    message = str(error.value)
    assert message.startswith(f"checkpoint {newest} is damaged: {name} ") and problem in message
    assert "--resume-fallback" in message and "\n" not in message
    weight = "layers.3.up.weight"
    assert not torch.equal(other.get_parameter(weight), module.get_parameter(weight))  # untouched
    with pytest.raises(CheckpointError, match=f"^checkpoint {newest} is damaged: {name} "):
        export_checkpoint(tmp_path, tmp_path / "model.pt")
    assert not (tmp_path / "model.pt").exists()
    assert cli(["export", "--checkpoint", str(tmp_path), "-o", str(tmp_path / "m.pt")]) == 1
    printed = capsys.readouterr().err.strip()
    assert printed.startswith(f"cutpipe export: checkpoint {newest} is damaged: {name} ")
    assert "\n" not in printed and "Traceback" not in printed
    # --resume-fallback: the newest intact older one, saying which
    restored = load(tmp_path, other, fallback=True)
    assert restored.step == 2 and restored.notes[0].endswith("passed over for an older checkpoint")
    assert torch.equal(other.get_parameter(weight), module.get_parameter(weight))
    said: list[str] = []
    with Checkpointer(tmp_path, say=said.append) as checkpoints:
        assert checkpoints.start(RESUME, other, fallback=True).step == 2
        assert said[-1] == f"resumed from {step_folder(tmp_path, 2)} (after step 2)"
        checkpoints.save(4, other)  # the damaged step 4 is moved aside, not refused or deleted
    (aside,) = tmp_path.glob("replaced-*")
    assert (aside / "step-000004" / name).exists()
    assert latest_checkpoint(tmp_path) == newest
    load(tmp_path, other)  # verified
    for step in (2, 4):  # and with no intact one left
        truncate(step_folder(tmp_path, step))
    with pytest.raises(CheckpointError, match="and no older checkpoint in .* is intact"):
        load(tmp_path, other, fallback=True)


def test_a_mark_without_checksums_loads_with_a_note(tmp_path):
    module = two_checkpoints(tmp_path, steps=(1,))
    folder = step_folder(tmp_path, 1)
    write_mark(folder, replace(Manifest.read(folder), files=None))  # as cutpipe wrote it before
    unverified = f"{folder} was saved without checksums (by an older cutpipe): read unverified"
    assert unverified in load(tmp_path, module).notes
    notes: list[str] = []
    export_checkpoint(tmp_path, tmp_path / "model.pt", note=notes.append)
    assert notes == [unverified]
    truncate(folder)  # unverified, so found only by DCP: still one line, no traceback
    with pytest.raises(CheckpointError, match=f"^cannot read the checkpoint {folder}: EOFError"):
        load(tmp_path, module)


def test_a_failed_background_write_stops_with_one_line_and_latest_stays(tmp_path, monkeypatch):
    """A full disk, simulated: DCP's writer fails as a write would with ENOSPC."""
    import torch.distributed.checkpoint.filesystem as dcp_files

    module = trained()[0]

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with Checkpointer(tmp_path, keep=1) as checkpoints:
        checkpoints.save(2, module)
        checkpoints.wait()
        with monkeypatch.context() as patch:
            patch.setattr(dcp_files, "_write_item", full)
            checkpoints.save(4, module)
            with pytest.raises(CheckpointError) as error:
                checkpoints.wait()
        assert str(error.value) == (
            f"checkpoint {step_folder(tmp_path, 4)} was not completed: OSError: [Errno 28] No "
            "space left on device; latest still names step-000002"
        )
        assert latest_checkpoint(tmp_path) == step_folder(tmp_path, 2)
        checkpoints.save(6, module)  # space again: its own unfinished step 4 goes with keep=1
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000006"]


def test_a_restarted_worker_resumes_its_own_launch_only(tmp_path):
    module = trained()[0]
    first = Checkpointer(tmp_path)
    assert first.start(FRESH, module, run="launch-1") is None
    first.save(2, module)
    first.wait()
    first.abandon()  # the worker died (no close): its launch's claim stays
    assert json.loads((tmp_path / RUN).read_text()) == {"run": "launch-1"}
    with Checkpointer(tmp_path) as restarted:
        assert restarted.start(FRESH, module, run="launch-1", restarted=True).step == 2
    assert not (tmp_path / RUN).exists()  # finished: released
    other = Checkpointer(tmp_path)
    with pytest.raises(ValueError, match="already holds checkpoints"):  # another launch's
        other.start(FRESH, module, run="launch-2", restarted=True)


def test_the_start_options_say_what_goes_together():
    directory = {"checkpoint_dir": "ckpt"}
    for flags, problem in [
        ({"resume": True, "overwrite": True}, "--overwrite starts a new run and --resume"),
        ({"resume_if_present": True, "overwrite": True}, "--overwrite starts a new run"),
        ({"resume": True, "resume_if_present": True}, "--resume-if-present already resumes"),
    ]:
        with pytest.raises(ValueError, match=problem):
            TrainOptions.build(**flags, **directory)
    for flag in ("resume", "resume_if_present", "resume_fallback", "overwrite"):
        with pytest.raises(ValueError, match="checkpoints need a directory"):
            TrainOptions.build(**{flag: True})
    TrainOptions.build(resume=True, resume_fallback=True, **directory)


def test_the_checks_before_any_worker_import_no_torch():
    """``folders`` and ``integrity`` import only the standard library and cutpipe's torch-free
    modules, so that a launcher may check a directory with them."""
    import ast

    import cutpipe.train.checkpoint as package

    root = Path(package.__file__).parent
    allowed = {
        "cutpipe.files",
        "cutpipe.train.checkpoint.errors",
        "cutpipe.train.checkpoint.folders",
    }
    for name in ("folders.py", "integrity.py", "errors.py"):
        for node in ast.walk(ast.parse((root / name).read_text())):
            if isinstance(node, ast.ImportFrom) and node.module.startswith("cutpipe"):
                assert node.module in allowed, (name, node.module)
            targets = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                targets = [node.module]
            assert not any(t.split(".")[0] == "torch" for t in targets), (name, targets)
