"""The training surfaces' contract, one representative probe per class of fault, end to end
through ``cutpipe train`` (docs/training.md, "Checkpoints" and "Launch"): bad input is one line
and exit status 2 before any training step, whether the launcher or a worker finds it; nothing
hangs on a file that is not a file; a signal ends the launcher with its documented status and
one line; SIGKILL of the launcher leaves no process behind; a resumed run says what it changed
and refuses another run's checkpoint."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cutpipe.train.checkpoint import latest_checkpoint, step_folder

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "models" / "tiny-dense.yaml")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def cutpipe(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "cutpipe", "train", "--nproc", "2", *args]
    return subprocess.run(
        command, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout
    )


def one_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


@pytest.mark.timeout(120)
def test_bad_input_the_launcher_finds_is_one_line_before_any_process(tmp_path):
    model = tmp_path / "bad.yaml"
    model.write_text(
        "layers: 4\nhidden: 64\nheads: 4\nffn: 32\nvocab: 256\nseq_len: 16\nkv_heads: 3\n"
    )
    result = cutpipe("-s", "1f1b", "--model", str(model), cwd=tmp_path)
    assert result.returncode == 2
    assert "kv_heads 3 must divide heads 4" in one_line(result)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes")
def test_a_named_pipe_in_the_data_is_skipped_and_said(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "text.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    os.mkfifo(data / "pipe")
    result = cutpipe("-s", "1f1b", "--model", TINY, "--data", str(data), "--steps", "1",
                     "--seq-len", "16", "--quiet", cwd=tmp_path, timeout=100)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "skipped 1 named pipe" in result.stdout and "1 steps: loss" in result.stdout


#: the checkpointed runs of this module: 1F1B on 2 processes, sequences of 32
RUN = ["-s", "1f1b", "--model", TINY, "--seq-len", "32", "--checkpoint-dir", "ck", "--quiet"]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder whose ``ck`` holds the checkpoint of a finished 2-step run (its step 2), from
    one launch; each test takes a copy."""
    folder = tmp_path_factory.mktemp("first")
    first = cutpipe(*RUN, "--steps", "2", cwd=folder)
    assert first.returncode == 0, first.stderr
    return folder / "ck"


@pytest.mark.timeout(240)
def test_resuming_says_what_it_changes_and_refuses_another_run_from_a_worker(first_run, tmp_path):
    """The launcher cannot read a checkpoint's record without torch: a worker finds another
    run's checkpoint, before any step, and the launcher says it once, with exit status 2."""
    shutil.copytree(first_run, tmp_path / "ck")
    changed = cutpipe(*RUN, "--steps", "3", "--resume", "--lr", "0.001", cwd=tmp_path)
    assert changed.returncode == 0, changed.stderr
    assert "resumed from ck/step-000002 (after step 2)" in changed.stdout
    assert "the resumed run changes lr 0.003 -> 0.001, steps 2 -> 3" in changed.stdout
    assert latest_checkpoint(tmp_path / "ck") == step_folder(tmp_path / "ck", 3)
    other = cutpipe(*RUN[:5], "64", *RUN[6:], "--steps", "4", "--resume", cwd=tmp_path)
    assert other.returncode == 2
    line = one_line(other)
    assert "of another run (seq_len 32 -> 64)" in line and line.startswith("cutpipe train: error:")


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, frontier = set(), [pid]
    while frontier:
        for child in children.get(frontier.pop(), []):
            found.add(child)
            frontier.append(child)
    return found


def _workers(pid: int) -> list[int]:
    """The worker processes the launcher ``pid`` started (its children that run cutpipe)."""
    found = []
    for child in _descendants(pid):
        try:
            stat = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()
            command = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat[1]) == pid and b"cutpipe" in command:
            found.append(child)
    return sorted(found)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


#: an emulated run that goes on until it is stopped
ENDLESS = [sys.executable, "-m", "cutpipe", "train", "--nproc", "2", "-s", "1f1b", "--emulate",
           "--steps", "100000", "--time-unit", "0.005", "--quiet"]  # fmt: skip


def _stepping(process: subprocess.Popen, metrics: Path, deadline: float) -> list[int]:
    """Wait until both workers of the launcher ``process`` are up and the run has logged 3
    steps to ``metrics``, or ``deadline`` (on ``time.monotonic``) passes; its workers."""
    workers: list[int] = []
    while time.monotonic() < deadline and (
        len(workers) < 2 or not metrics.exists() or len(metrics.read_text().splitlines()) < 3
    ):
        time.sleep(0.2)
        workers = _workers(process.pid)  # not a helper a worker may start for a moment
    return workers


@pytest.mark.timeout(180)
@pytest.mark.skipif(not Path("/proc").exists(), reason="reads the process tree from /proc")
@pytest.mark.parametrize("when", ["starting", "running"])
def test_sigkill_of_the_launcher_leaves_no_process(tmp_path, when):
    """Killed outright while its workers start (still importing) or train, the launcher takes
    them with it: each worker asks for a parent-death signal as its first line of Python."""
    metrics = tmp_path / "m.jsonl"
    process = subprocess.Popen([*ENDLESS, "--metrics", str(metrics)], cwd=tmp_path, env=ENV,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    seen: set[int] = set()
    deadline = time.monotonic() + 90
    while len(seen) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
        seen |= _descendants(process.pid)
    assert seen, "no worker started"
    if when == "running":
        assert len(_stepping(process, metrics, time.monotonic() + 90)) == 2, "never stepped"
        seen |= _descendants(process.pid)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in seen) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in seen if _alive(p)], "processes outlived their launcher"


@pytest.mark.timeout(120)
@pytest.mark.skipif(not Path("/proc").exists(), reason="reads the process tree from /proc")
def test_sigterm_to_the_launcher_is_its_status_and_one_line_and_ends_every_worker(tmp_path):
    """Once the run is stepping (SIGINT: tests/test_faults.py)."""
    metrics = tmp_path / "m.jsonl"
    process = subprocess.Popen([*ENDLESS, "--metrics", str(metrics)], cwd=tmp_path, env=ENV,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    workers = _stepping(process, metrics, time.monotonic() + 90)
    assert len(workers) == 2, "the workers never stepped"
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 143
    assert stderr.strip() == "cutpipe train: stopped by SIGTERM", stderr
    time.sleep(1)
    assert not [p for p in workers if _alive(p)], "orphaned workers"


@pytest.mark.timeout(240)
def test_a_checkpoint_directory_is_never_lost_and_a_damaged_shard_is_found(first_run, tmp_path):
    """A fresh run into an old run's folder and a resume from nothing are refused before any
    worker starts, the folder left byte for byte; a shard damaged on disk is found before it is
    used, in one line naming it."""
    shutil.copytree(first_run, tmp_path / "ck")
    before = listing(tmp_path / "ck")
    fresh = cutpipe(*RUN, "--steps", "2", cwd=tmp_path)
    assert fresh.returncode == 2
    assert "--checkpoint-dir ck already holds checkpoints" in one_line(fresh)
    assert listing(tmp_path / "ck") == before  # nothing saved, moved or deleted
    elsewhere = [*RUN[:6], "--checkpoint-dir", "elsewhere", "--quiet", "--resume"]
    nothing = cutpipe(*elsewhere, cwd=tmp_path)
    assert nothing.returncode == 2 and "--resume" in one_line(nothing)
    shard = next((tmp_path / "ck" / "step-000002").glob("*.distcp"))
    with open(shard, "r+b") as file:
        file.seek(shard.stat().st_size // 2)
        file.write(bytes(8192))
    damaged = cutpipe(*RUN, "--steps", "3", "--resume", cwd=tmp_path)
    assert damaged.returncode == 1
    line = one_line(damaged)
    assert shard.name in line and "step-000002" in line
    assert (tmp_path / "ck" / "step-000002" / shard.name).exists()  # nothing deleted


def listing(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` with its bytes, by relative path."""
    return {
        str(path.relative_to(directory)): path.read_bytes()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


@pytest.mark.timeout(300)
@pytest.mark.skipif(not Path("/proc").exists(), reason="reads process states from /proc")
def test_a_stopped_rank_is_named_frozen(tmp_path):
    """SIGSTOP of one worker once the run is stepping: its heartbeat stops, the host says its
    process is stopped, and the launcher's one line names it as frozen (the runtime's own
    words). (Stopped before its first step, a worker has no heartbeat yet to miss: the others
    wait at start-up, as for a slow machine, until the rendezvous times out.) The guard waits 3 s
    of silence and 3 s stuck, not its defaults' 20 and 10 (tests/test_faults.py checks the
    guard's own timing)."""
    metrics = tmp_path / "m.jsonl"
    env = {**ENV, "CUTPIPE_GUARD_SECONDS": "3:3"}
    process = subprocess.Popen([*ENDLESS, "--metrics", str(metrics)], cwd=tmp_path, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    workers = _stepping(process, metrics, time.monotonic() + 120)
    stopped, other = workers[-1], workers[0]
    os.kill(stopped, signal.SIGSTOP)
    deadline = time.monotonic() + 90
    while _alive(other) and time.monotonic() < deadline:  # until the guard has stopped it
        time.sleep(0.5)
    # the agent's SIGTERM waits while the process is stopped (it would kill it 30 s later):
    # let it go on, as a debugger that detaches would
    os.kill(stopped, signal.SIGCONT)
    try:
        _, stderr = process.communicate(timeout=120)
    finally:
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert process.returncode == 1
    assert "is frozen" in stderr and "stopped (SIGSTOP or a debugger)" in stderr, stderr
    assert len([line for line in stderr.splitlines() if line.strip()]) == 1, stderr
