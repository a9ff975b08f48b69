"""``cutpipe train`` on a real model: exact against one process, recompute, checkpoints that
survive a killed worker and reshard, the elastic agent and two-node rendezvous."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import train_workers as workers

from cutpipe.cli.main import main as cli
from cutpipe.launch import run
from cutpipe.train.metrics import read_metrics
from cutpipe.train.options import TrainOptions

#: Small enough for 4 processes on 2 cores; 8 blocks fill a V on 4 ranks.
MODEL = """\
name: test-lm
layers: 6
hidden: 32
heads: 2
ffn: 64
vocab: 256
seq_len: 32
microbatch_size: 2
dtype: fp32
"""
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module", autouse=True)
def one_thread_per_worker() -> Iterator[None]:
    """The workers this module spawns train on one thread each, as ENV has the CLI's do: with
    OMP_NUM_THREADS unset the trainer gives each of them every core, and the oversubscribed
    cores made these tests many times slower on a small loaded machine."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        yield


@pytest.fixture
def model_file(tmp_path: Path) -> str:
    path = tmp_path / "model.yaml"
    path.write_text(MODEL)
    return str(path)


@pytest.fixture(scope="module")
def module_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("model") / "model.yaml"
    path.write_text(MODEL)
    return str(path)


def options(model: str, schedule: str, **changes) -> TrainOptions:
    settings = dict(
        model=model, schedule=schedule, steps=8, microbatches=4, global_batch=8, quiet=True
    )
    return TrainOptions.build(**{**settings, **changes})


#: the one-process references: the default run, and 3 steps of the 16-sequence batch (DP tests)
REFERENCES = {"default": {}, "3 steps of 16": dict(steps=3, global_batch=16, microbatches=8)}


@pytest.fixture(scope="module")
def references(module_model: str) -> dict[str, dict]:
    """Each of ``REFERENCES`` trained by one process (1F1B on one rank), in one launch."""
    runs = [options(module_model, "1f1b", **changes) for changes in REFERENCES.values()]
    results = run(workers.train_runs, 1, (runs,), timeout=240)[0]
    return dict(zip(REFERENCES, results, strict=True))


#: the 2-process runs of this module's tests, trained in one launch: DualPipeV with the
#: optimizer step synchronous and overlapped, ZB-V without and with full recompute, DualPipeV in
#: fp32 and bf16
BOUNDARIES = [{}, {"step_boundary": "overlap", "skip_nonfinite": True}]
RECOMPUTE = ("none", "full")
DTYPES = ("fp32", "bf16")


@pytest.fixture(scope="module")
def two_processes(module_model: str) -> dict[str, list[list[dict]]]:
    """Each rank's results of the 2-process runs, by the test that checks them."""
    groups = {
        "boundaries": [options(module_model, "dualpipev", **b) for b in BOUNDARIES],
        "recompute": [options(module_model, "zbv", steps=2, recompute=m) for m in RECOMPUTE],
        "dtypes": [options(module_model, "dualpipev", steps=3, dtype=d) for d in DTYPES],
    }
    calls = [("train_runs", (runs,)) for runs in groups.values()]
    ranks = run(workers.in_turn, 2, (calls,), timeout=280)
    return {name: [rank[i] for rank in ranks] for i, name in enumerate(groups)}


@pytest.mark.timeout(300)
def test_pipelined_training_follows_one_process(two_processes, references):
    """``cutpipe train``'s loop on DualPipeV against one process (tests/test_train_optim.py runs
    every schedule, DualPipe's two copies included, through the runtime itself), with the
    optimizer step synchronous and overlapped (post-validated: the clip bites on most steps, so
    most optimistic steps are rolled back and redone)."""
    reference = references["default"]
    results = two_processes["boundaries"][0]
    for result, boundary in zip(results, BOUNDARIES, strict=True):
        losses = result["losses"]
        assert len(losses) == 8 and losses[-1] < losses[0]
        assert [r["step"] for r in result["records"]] == list(range(1, 9))
        assert losses == pytest.approx(reference["losses"], rel=1e-5), boundary
        norms = [r["grad_norm"] for r in result["records"]]
        assert norms == pytest.approx([r["grad_norm"] for r in reference["records"]], rel=1e-5)


#: the 4-process runs (PP2 x DP2): 3 steps of the 16-sequence batch, each replica half of it
SAME = dict(steps=3, global_batch=16)


@pytest.fixture(scope="module")
def four_processes(module_model: str, tmp_path_factory: pytest.TempPathFactory) -> list[list]:
    """Rank 0's results of the 4-process runs, in one launch: ZeRO-1; FSDP2 saving after step
    2 and 3, then resumed from step 2 (test_fsdp_replicas_follow_one_process_and_resume_bitwise)."""
    zero1 = options(module_model, "dualpipev", dp=2, dp_mode="zero1", microbatches=4, **SAME)
    folder = tmp_path_factory.mktemp("fsdp") / "ckpt"
    fsdp = dict(dp=2, dp_mode="fsdp", microbatches=4, checkpoint_dir=str(folder))
    whole = options(module_model, "dualpipev", checkpoint_every=2, **fsdp, **SAME)
    again = options(module_model, "dualpipev", resume=True, **fsdp, **SAME)
    calls = [("train_rank", (zero1,)), ("train_and_resume", (whole, again, 2))]
    return run(workers.in_turn, 4, (calls,), timeout=280)[0]


@pytest.mark.timeout(300)
def test_data_parallel_replicas_follow_one_process(four_processes, references):
    """PP2 x DP2 with ZeRO-1 on the same global batch (each replica half of it): the losses of
    one process running all eight microbatches (tests/test_data_parallel.py checks every mode's
    gradients and parameters; this is the trainer's wiring: mesh, shards, sharded AdamW)."""
    reference = references["3 steps of 16"]
    losses = four_processes[0]["losses"]
    assert len(losses) == 3
    for got, want in zip(losses, reference["losses"], strict=True):
        assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.timeout(300)
def test_fsdp_replicas_follow_one_process_and_resume_bitwise(
    module_model, four_processes, references
):
    """PP2 x DP2 with FSDP2 (sharded parameters, gradients and AdamW state): the losses and
    pre-clip gradient norms of one process (clipping bites at step 1, so the norm over the DP
    shards must be whole), and a checkpoint of the shards resumed by the same layout continues
    bitwise (tests/test_fsdp.py checks the gradients and parameters themselves). The resumed run
    is a new run in the same processes (a killed worker's restart in new processes:
    test_a_killed_worker_restarts_and_resumes_bitwise)."""
    reference = references["3 steps of 16"]
    whole, resumed = four_processes[1]
    norms = [record["grad_norm"] for record in whole["records"]]
    assert norms[0] > options(module_model, "dualpipev").clip
    assert norms == pytest.approx([r["grad_norm"] for r in reference["records"]], rel=1e-5)
    assert whole["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert resumed["resumed_from"] == 2
    assert resumed["losses"] == whole["losses"][2:]


@pytest.mark.timeout(300)
def test_full_recompute_halves_the_activation_peak_at_equal_losses(two_processes):
    ranks = two_processes["recompute"]
    peaks = {mode: max(r[i]["records"][-1]["peak_activation_bytes"] for r in ranks)
             for i, mode in enumerate(RECOMPUTE)}  # fmt: skip
    losses = {mode: ranks[0][i]["losses"] for i, mode in enumerate(RECOMPUTE)}
    assert losses["full"] == pytest.approx(losses["none"], rel=1e-6)
    assert peaks["none"] >= 2 * peaks["full"], peaks


@pytest.mark.timeout(300)
def test_bf16_autocast_tracks_fp32(two_processes):
    first = two_processes["dtypes"][0]
    runs = {dtype: first[i]["losses"] for i, dtype in enumerate(DTYPES)}
    assert runs["bf16"] != runs["fp32"]  # the forwards really ran in bf16
    assert runs["bf16"] == pytest.approx(runs["fp32"], rel=3e-2)


def cutpipe_train(*arguments: str, env: dict | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "cutpipe", "train", "--quiet", *arguments]
    return subprocess.run(command, capture_output=True, text=True, timeout=280, env=env or ENV)


def _losses(log: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(log)}


#: the uninterrupted run of the two tests below: DualPipeV on 2 processes, 6 steps of the
#: model's 16-sequence global batch, checkpoints after steps 2, 4 and 6 (the last two kept)
WHOLE = ["--schedule", "dualpipev", "--nproc", "2", "--steps", "6", "--checkpoint-every", "2"]


@pytest.fixture(scope="module")
def whole_run(module_model: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with the uninterrupted run's checkpoints (``ckpt``), log (``whole.jsonl``) and
    the torch profiler's trace of its steps 2 and 3 (``profile``), from one launch."""
    folder = tmp_path_factory.mktemp("whole")
    whole = cutpipe_train("--model", module_model, *WHOLE, "--checkpoint-dir", str(folder / "ckpt"),
                          "--log", str(folder / "whole.jsonl"), "--profile-steps", "2:3",
                          "--profile-dir", str(folder / "profile"))  # fmt: skip
    assert whole.returncode == 0, whole.stderr[-3000:]
    return folder


@pytest.mark.timeout(600)
def test_a_killed_worker_restarts_and_resumes_bitwise(module_model, whole_run, tmp_path):
    trace = json.loads((whole_run / "profile" / "rank1.json").read_text())["traceEvents"]
    names = [event.get("name", "") for event in trace]
    assert sum(name.startswith("ProfilerStep") for name in names) == 2  # steps 2 and 3
    assert "PP:1F0" in names and "PP:(2F2;1B0)OVERLAP_F_B" in names  # torch's action names
    env = {**ENV, "CUTPIPE_FAULT_KILL": "1:5"}  # rank 1 dies as step 5 begins
    killed = cutpipe_train("--model", module_model, *WHOLE, "--checkpoint-dir", str(tmp_path / "b"),
                           "--log", str(tmp_path / "b.jsonl"), "--max-restarts", "1", env=env)  # fmt: skip
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert "resumed after step" in killed.stdout, killed.stdout
    resumed = int(killed.stdout.split("resumed after step ")[1].split(";")[0].split()[0])
    assert resumed in (2, 4)  # the last checkpoint complete when the worker died
    steps = [json.loads(line)["step"] for line in (tmp_path / "b.jsonl").read_text().splitlines()]
    # only steps after the checkpoint ran twice; under load rank 0 may not have logged step 4
    # before rank 1 died at the start of step 5
    logged = steps[: len(steps) - (6 - resumed)]
    assert logged in ([1, 2, 3, 4], [1, 2, 3]) and len(logged) >= resumed, steps
    assert steps[len(logged) :] == list(range(resumed + 1, 7)), steps
    assert _losses(tmp_path / "b.jsonl") == _losses(whole_run / "whole.jsonl")  # bitwise


@pytest.mark.timeout(600)
def test_a_two_process_checkpoint_resumes_on_four_with_the_same_global_batch(
    module_model, whole_run, tmp_path
):
    """The same command on 2 processes and on 4 trains the same global batch (16 sequences, the
    model's default), cut into other microbatches: DualPipeV's checkpoint of 2 ranks resumes
    into DualPipe's two copies of every stage on 4 ranks with the uninterrupted run's losses."""
    shutil.copytree(whole_run / "ckpt", tmp_path / "ckpt")
    # go back to the checkpoint after step 4, as a run that stopped there would have left it
    shutil.rmtree(tmp_path / "ckpt" / "step-000006")
    (tmp_path / "ckpt" / "latest").write_text("step-000004")
    expected = _losses(whole_run / "whole.jsonl")
    directory = tmp_path / "ckpt-dualpipe"
    shutil.copytree(tmp_path / "ckpt", directory)
    log = tmp_path / "dualpipe.jsonl"
    resumed = cutpipe_train("--model", module_model, "--steps", "6", "--schedule", "dualpipe",
                            "--nproc", "4", "--resume", "--checkpoint-dir", str(directory),
                            "--log", str(log))  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "the resumed run changes schedule dualpipev -> dualpipe, microbatches 4 -> 8" in (
        resumed.stdout
    ), resumed.stdout
    got = _losses(log)
    assert sorted(got) == [5, 6], got
    for step, loss in got.items():
        assert loss == pytest.approx(expected[step], rel=1e-5, abs=1e-6), step
    exported = tmp_path / "model.safetensors"  # `cutpipe export` in this process
    assert cli(["export", "--checkpoint", str(tmp_path / "ckpt"), "-o", str(exported)]) == 0
    from cutpipe.models import language_model, load_model_config
    from cutpipe.train.checkpoint import read_safetensors

    language_model(load_model_config(module_model)).load_state_dict(read_safetensors(exported))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


@pytest.mark.timeout(300)
def test_two_agents_meet_at_a_c10d_rendezvous(model_file, tmp_path):
    command = [sys.executable, "-m", "cutpipe", "train", "--quiet", "--model", model_file,
               "--schedule", "1f1b", "--nproc", "1", "--nnodes", "2", "--steps", "3",
               "--rdzv-endpoint", f"localhost:{_free_port()}", "--rdzv-id", "two-nodes"]  # fmt: skip
    agents = [
        subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV
        )
        for _ in range(2)
    ]
    outputs = [agent.communicate(timeout=240) for agent in agents]
    for agent, (_, err) in zip(agents, outputs, strict=True):
        assert agent.returncode == 0, err[-3000:]
    printed = "".join(out for out, _ in outputs)
    assert printed.count("3 steps: loss") == 1, printed  # rank 0 reports, on one of the agents
