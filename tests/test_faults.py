"""Faults injected into real process groups (gloo, spawned processes, and torchrun): whatever
happens to a rank, every rank stops within a bounded time and says which rank and where.

Times are bounds with wide margins (the machine may be loaded), measured from the moment the
ranks start their runners, not from process start-up."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import fault_workers as faults
import pytest

from cutpipe.launch import LaunchError, run, spawn

ROOT = Path(__file__).parents[1]


def seconds_of(text: str) -> float:
    return float(re.search(r"after ([0-9.]+)s", text).group(1))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_failing_rank_stops_every_rank_naming_it(how):
    outcomes = spawn(faults.failing, 4, (how, 2, "1f1b"), timeout=120)
    victim = outcomes[2]
    if how == "kill":
        assert victim.exitcode == -9 and "SIGKILL" in victim.reason
    else:
        assert victim.ok and victim.result.startswith("ValueError: boom")
    for outcome in outcomes:
        if outcome.rank == 2:
            continue
        assert outcome.ok, outcome.stderr
        text = outcome.result
        if how == "raise":
            assert "rank 2 failed in step 1 at 2F" in text, text
            assert "ValueError: boom in a stage module" in text
        else:
            assert "rank 2 died (last seen in step 1 at 2" in text, text
        assert seconds_of(text) < 30, text
    slowest = max(seconds_of(o.result) for o in outcomes if o.rank != 2)
    print(f"a rank that {how}s: every other rank stopped within {slowest:.1f} s")


@pytest.mark.timeout(180)
def test_ranks_that_disagree_all_stop_with_one_message_naming_both_sides():
    results = run(faults.mismatches, 2, timeout=150)
    want = {
        "schedules": "the ranks run different schedules: rank 0 runs 1f1b m=8 on 2 ranks, "
        "rank 1 runs 1f1b m=4 on 2 ranks",
        "names": "rank 0 runs 1f1b m=4 on 2 ranks, rank 1 runs zbh1 m=4 on 2 ranks",
        "emulated": "rank 1 runs 1f1b m=4 on 2 ranks (emulated)",
        "batch": "the ranks were given different batch sizes: rank 0 inputs of 8, rank 0 targets "
        "of 8, rank 1 inputs of 12, rank 1 targets of 12",
        "grad mode": "rank 0 a training step, rank 1 a forward-only step (torch.no_grad())",
    }
    for rank, outcomes in enumerate(results):
        for case, message in want.items():
            text = outcomes[case]
            assert text.startswith("MismatchError"), (rank, case, text)
            assert message in text, (rank, case, text)
            assert seconds_of(text) < 30, (rank, case, text)
        assert outcomes["agreed"] == "no error", outcomes["agreed"]
    slowest = max(seconds_of(o[case]) for o in results for case in want)
    print(f"ranks that disagree: every rank stopped within {slowest:.1f} s")


@pytest.mark.timeout(180)
def test_a_live_hang_stops_every_rank_within_the_step_timeout_naming_the_stuck_op():
    step_timeout = 4.0
    started = time.monotonic()
    outcomes = spawn(faults.hang, 3, (1, "loop", step_timeout), timeout=150, grace=10)
    took = time.monotonic() - started
    stuck = outcomes[1]
    assert stuck.exitcode == 1, stuck
    assert "rank 1 made no progress for" in stuck.stderr, stuck.stderr
    assert (
        "it is running 1F" in stuck.stderr and "of step 2, which has not returned" in stuck.stderr
    )
    for outcome in (outcomes[0], outcomes[2]):
        text = outcome.result if outcome.ok else outcome.stderr
        assert "rank 1 made no progress" in text, text
        if outcome.ok:
            assert text.startswith("PipelineError"), text
            assert seconds_of(text) < step_timeout + 15, text
            print(f"a live hang (step_timeout {step_timeout:g} s): rank {outcome.rank} stopped "
                  f"{seconds_of(text):.1f} s after its step began")  # fmt: skip
    assert took < 120, took  # start-up included; the watchdog, not the deadline, ended it


@pytest.mark.timeout(180)
def test_a_rank_holding_the_gil_shorter_than_the_step_timeout_is_not_declared_dead():
    # the heartbeat stops for 8 s, four times dead_after: the host still sees a running process
    results = run(faults.hang, 2, (1, "gil", 30.0), timeout=150)
    for text in results:
        assert text.startswith("finished"), text
    assert results[0] == results[1]


@pytest.mark.timeout(180)
def test_a_frozen_rank_is_named_and_the_launcher_kills_it():
    started = time.monotonic()
    outcomes = spawn(faults.frozen, 3, (1,), timeout=150, grace=5)
    took = time.monotonic() - started
    assert outcomes[1].exitcode == -signal.SIGKILL, outcomes[1]
    assert outcomes[1].note.startswith("killed: still running 5 s after rank"), outcomes[1].note
    for outcome in (outcomes[0], outcomes[2]):
        text = outcome.result if outcome.ok else outcome.stderr
        assert "rank 1 is frozen" in text and "is stopped (SIGSTOP" in text, text
        if outcome.ok:
            print(f"a frozen rank (dead_after 3 s): rank {outcome.rank} stopped "
                  f"{seconds_of(text):.1f} s after its step began")  # fmt: skip
    assert took < 120, took


@pytest.mark.timeout(180)
def test_a_rank_stopped_between_steps_is_named_by_the_ranks_waiting_for_it():
    """Waiting in a collective between steps (here the timeline's gather) is watched as a step
    is: the waiting rank names the stopped one and ends its process, which gloo's blocking wait
    would otherwise hold for its 30-minute timeout."""
    outcomes = spawn(faults.frozen_between_steps, 2, (1,), timeout=150, grace=5)
    assert outcomes[1].exitcode == -signal.SIGKILL, outcomes[1]
    waiting = outcomes[0]
    assert waiting.exitcode == 1, waiting
    assert (
        "rank 0 stops (stuck in gathering the measured timeline (after step 1))" in waiting.stderr
    )
    assert "rank 1 is frozen" in waiting.stderr and "is stopped (SIGSTOP" in waiting.stderr


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["raise", "exit"])
def test_a_rank_that_fails_outside_its_ops_is_named_with_where_it_was(how):
    outcomes = spawn(faults.between_steps, 2, (1, how), timeout=150)
    text = outcomes[0].result if outcomes[0].ok else outcomes[0].stderr
    victim = outcomes[1]
    if how == "raise":
        assert "rank 1 raised ValueError: the data loader broke" in text, text
        assert "between steps (after step 1)" in text, text
        # never "exit code 0": 1 from the exception, or, on a loaded machine, SIGABRT from a
        # C++ thread torn down while the interpreter exits after it (seen once in a busy run)
        assert victim.exitcode in (1, -6) and not victim.ok
        assert victim.reason == "ValueError: the data loader broke"
    else:
        # it dies inside step 2's forward; whether its heartbeat thread had written "step 2"
        # before os._exit is a race on a loaded machine, so either step is its last sighting
        assert re.search(r"rank 1 died \(last seen in step [12]\b", text), text
        assert "set-up" not in text
        assert victim.exitcode == 3 and victim.reason == "its process exited with code 3"


@pytest.mark.timeout(120)
def test_the_launcher_returns_soon_after_a_failure_and_at_its_deadline():
    started = time.monotonic()
    outcomes = spawn(faults.lingering, 2, timeout=100, grace=3)
    assert time.monotonic() - started < 60
    assert outcomes[0].exitcode == 1 and "rank 0 gives up" in outcomes[0].reason
    assert outcomes[1].note == "killed: still running 3 s after rank 0 failed"
    with pytest.raises(LaunchError) as failure:
        run(faults.sleeping, 2, timeout=4)
    assert failure.value.summary == "timed out after 4 s: ranks 0, 1 were still running"


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


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not Path("/proc").exists(), reason="reads the process tree from /proc")
@pytest.mark.timeout(180)
# SIGTERM: tests/test_train_probes.py, test_sigterm_to_the_launcher_is_its_status_and_one_line_...
@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, 130)])
def test_a_signal_to_cutpipe_train_stops_every_worker_quietly(signum, status):
    command = [sys.executable, "-m", "cutpipe.cli.main", "train", "--schedule", "1f1b", "--nproc",
               "2", "--emulate", "--steps", "100000", "--time-unit", "0.005"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    workers: set[int] = set()
    deadline = time.monotonic() + 120
    while len(workers) < 2 and time.monotonic() < deadline:  # the agent's two workers
        time.sleep(0.5)
        workers = {p for p in _descendants(process.pid) if "-m cutpipe train" in _cmdline(p)}
    assert len(workers) >= 2, "the workers never started"
    time.sleep(2)
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == status, stderr
    assert "Traceback" not in stderr, stderr
    time.sleep(1)
    assert not [p for p in workers if _alive(p)], "orphaned workers"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


class _Torchrun:
    """``tests/fault_script.py FAULT`` under ``torch.distributed.run``, started now. Its output
    goes to files (a job left running never blocks on a pipe) and a thread notes when it ends."""

    def __init__(self, fault: str, folder: Path) -> None:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                   "2", str(ROOT / "tests" / "fault_script.py"), fault]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self._files = [folder / f"{fault}.out", folder / f"{fault}.err"]
        with open(self._files[0], "w") as out, open(self._files[1], "w") as err:
            started = time.monotonic()
            self._process = subprocess.Popen(command, stdout=out, stderr=err, env=env)
        self._took = float("inf")

        def wait() -> None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(timeout=150)
                self._took = time.monotonic() - started

        self._waiter = threading.Thread(target=wait, daemon=True)
        self._waiter.start()

    def finish(self) -> tuple[int | None, str, str, float]:
        """(exit status, stdout, stderr, seconds from its start to its end); a job still running
        150 s after its start is killed (inf seconds)."""
        self._waiter.join()
        self.kill()
        out, err = (path.read_text() for path in self._files)
        return self._process.returncode, out, err, self._took

    def kill(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()


@pytest.mark.timeout(600)
def test_faults_under_torchrun_end_the_job_naming_the_rank(tmp_path):
    """Without a fault the script trains its 3 steps; each fault ends the job, and the output
    names the rank. The hang, which mostly waits for the watchdog, runs beside the others."""
    hang = _Torchrun("hang", tmp_path)
    try:
        status, stdout, stderr, _ = _Torchrun("none", tmp_path).finish()
        assert status == 0, stderr[-3000:]
        assert stdout.count("loss") == 3
        expectations = {
            "mismatch": "rank 0 runs 1f1b m=4 on 2 ranks, rank 1 runs 1f1b m=8 on 2 ranks",
            "between": "ValueError: the data loader broke",
            "raise": "rank 1 failed in step 2 at 1F",
            "hang": "rank 1 made no progress for",
        }
        for fault, message in expectations.items():
            job = hang if fault == "hang" else _Torchrun(fault, tmp_path)
            status, stdout, stderr, took = job.finish()
            output = stdout + stderr
            assert status != 0, (fault, output[-3000:])
            assert message in output, (fault, output[-3000:])
            assert took < 100, (fault, took)
    finally:
        hang.kill()


@pytest.mark.timeout(120)
def test_cutpipe_train_says_when_it_timed_out_in_one_line():
    command = [sys.executable, "-m", "cutpipe.cli.main", "train", "--schedule", "1f1b", "--nproc",
               "2", "--emulate", "--steps", "100000", "--time-unit", "0.005", "--timeout", "5"]  # fmt: skip
    started = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, timeout=100)
    assert time.monotonic() - started < 60
    assert result.returncode == 1, result.stderr
    first = result.stderr.splitlines()[0]
    assert first == "cutpipe train: timed out after 5 s: ranks 0, 1 were still running", first
    assert "Traceback" not in result.stderr


# -- what cutpipe train's launcher says when its workers fail ---------------------------------


class _Failure:
    """Stands for torch's ProcessFailure: what the agent read of one worker."""

    def __init__(self, message: str, exitcode: int = 1, timestamp: int = 0) -> None:
        recorded = ": " in message
        self.message = {"message": message, "extraInfo": {}} if recorded else ""
        self.error_file_data = {"message": self.message} if recorded else {"message": ""}
        self.exitcode, self.timestamp = exitcode, timestamp


def test_the_launcher_names_the_failure_that_came_first_in_its_own_right():
    from cutpipe.launch.elastic import root_cause, worker_failures

    failures = worker_failures({
        0: _Failure("PipelineError: rank 1 failed in step 2 at 1F0: ValueError: bad"),
        1: _Failure("ValueError: bad\nmore", timestamp=5),
        2: _Failure("", exitcode=-15),
    })  # fmt: skip
    assert [str(f) for f in failures] == [
        "rank 0: PipelineError: rank 1 failed in step 2 at 1F0: ValueError: bad",
        "rank 1: ValueError: bad",
        "rank 2: SIGTERM",
    ]
    cause = root_cause(failures)
    assert cause is not None and cause.rank == 1 and cause.is_input_error
    guard_only = worker_failures(
        {0: _Failure("", -9), 1: _Failure("PipelineError: rank 0 is frozen")}
    )
    assert root_cause(guard_only).rank == 1  # the guard's record says more than a signal
    assert root_cause(worker_failures({0: _Failure("", 3)})).kind == "exit code 3"
