"""``cutpipe train --ep``: an MoE trained with expert parallelism and overlapped F&B pairs through
the trainer follows one process training the same model on the same global batch, with the
overlap hook on and off alike, and its checkpoints hold every expert under its index in the
whole model, so they reload into other layouts and export whole (docs/moe.md, "Training")."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import train_workers as workers

from cutpipe.launch import run
from cutpipe.plan.plan_file import PlanFile
from cutpipe.train.options import TrainOptions

#: 4 experts (top-2) over EP 2; 6 blocks fill a V on 2 ranks; the first layer dense
MODEL = """\
name: test-moe
layers: 4
hidden: 32
heads: 2
ffn: 32
experts: 4
top_k: 2
dense_layers: 1
vocab: 256
seq_len: 16
microbatch_size: 2
dtype: fp32
"""
SCHEDULES = ("dualpipe", "dualpipev", "zbv", "1f1b")


@pytest.fixture(scope="module", autouse=True)
def one_thread_per_worker() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        yield


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("moe") / "model.yaml"
    path.write_text(MODEL)
    return str(path)


def options(model: str, schedule: str, **changes) -> TrainOptions:
    """3 steps of a 16-sequence global batch; no load-balancing loss, which each replica takes
    over its own share (docs/moe.md): the one-process reference takes it over the whole batch."""
    settings = dict(
        model=model, schedule=schedule, steps=3, global_batch=16, quiet=True, aux_weight=0.0
    )
    return TrainOptions.build(**{**settings, **changes})


#: a clip that every step's gradients exceed: the step boundary's verdict scales them
CLIPPED = {"clip": 0.05}


@pytest.fixture(scope="module")
def references(model_file: str) -> list[dict]:
    """One process on the same global batch: unclipped beyond the default, and clipped."""
    runs = [options(model_file, "1f1b", microbatches=4, **change) for change in ({}, CLIPPED)]
    return run(workers.train_runs, 1, (runs,), timeout=240)[0]


@pytest.fixture(scope="module")
def reference(references: list[dict]) -> dict:
    return references[0]


@pytest.mark.timeout(600)
def test_pp2_x_ep2_follows_one_process_for_every_schedule_hook_recompute_and_boundary(
    model_file, references, tmp_path
):
    """Every schedule against one process; DualPipeV also without the hook and with selective
    and full recompute (which rerun each phased piece in the backward half of its pair), each
    bit for bit the hooked run without recompute; and clipped by the runner's step boundary,
    overlapped and with skipping armed, against one process clipped alike."""
    reference, clipped = references
    variants = {"without the hook": dict(no_overlap=True), "selective": dict(recompute="selective"),
                "full": dict(recompute="full")}  # fmt: skip
    # the runner's step boundary: its verdict sums the experts' squares over the EP group
    boundaries = {"overlap": dict(step_boundary="overlap", **CLIPPED),
                  "skip": dict(skip_nonfinite=True, **CLIPPED)}  # fmt: skip
    # the same global batch in two pipeline steps; bf16 autocast (not exact: within its rounding)
    others = {"accumulated": dict(global_batch=16, grad_accum=2), "bf16": dict(dtype="bf16")}
    # an expert-parallel plan file, as recommend -o writes one (EP counted inside DP)
    plan = PlanFile(model="test-moe", layers=4, schedule="dualpipev", microbatches=4,
                    stage_sizes=(2, 1, 1, 2), pp=2, dp=2, ep=2)  # fmt: skip
    plan.save(tmp_path / "plan.json")
    planned = TrainOptions.build(model=model_file, plan=str(tmp_path / "plan.json"), steps=3,
                                 global_batch=16, quiet=True, aux_weight=0.0)  # fmt: skip
    runs = [options(model_file, name, ep=2) for name in SCHEDULES]
    runs += [options(model_file, "dualpipev", ep=2, **change) for change in variants.values()]
    runs += [options(model_file, "dualpipev", ep=2, **change) for change in boundaries.values()]
    runs += [options(model_file, "dualpipev", ep=2, **change) for change in others.values()]
    runs.append(planned)
    steered = dict(routing_bias_rate=0.001, capacity_factor=1.0)  # watched below, not compared
    runs.append(options(model_file, "dualpipe", ep=2, **steered))
    *results, watched = run(workers.train_runs, 4, (runs,), timeout=540)[0]
    *results, overlapped, skipping, accumulated, bf16, from_plan = results
    assert from_plan["stage_sizes"] == [2, 1, 1, 2]  # the plan's partition ran
    assert from_plan["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert accumulated["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    norms = [r["grad_norm"] for r in accumulated["records"]]
    assert norms == pytest.approx([r["grad_norm"] for r in reference["records"]], rel=1e-5)
    assert bf16["losses"] == pytest.approx(reference["losses"], rel=2e-2)
    for name, result in zip([*SCHEDULES, *variants], results, strict=True):
        assert result["losses"] == pytest.approx(reference["losses"], rel=1e-5), name
        norms = [r["grad_norm"] for r in result["records"]]
        assert norms == pytest.approx([r["grad_norm"] for r in reference["records"]], rel=1e-5)
    hooked = results[1]
    for name, variant in zip(variants, results[len(SCHEDULES) :], strict=True):
        # the hook changes the order and recompute what is kept, not the numbers
        assert variant["losses"] == hooked["losses"], name
        assert [r["grad_norm"] for r in variant["records"]] == [
            r["grad_norm"] for r in hooked["records"]
        ], name
    for name, result in (("overlap", overlapped), ("skip", skipping)):
        norms = [r["grad_norm"] for r in result["records"]]
        wanted = [r["grad_norm"] for r in clipped["records"]]
        assert min(wanted) > CLIPPED["clip"]  # every step was clipped
        assert norms == pytest.approx(wanted, rel=1e-5), name
        assert result["losses"] == pytest.approx(clipped["losses"], rel=1e-5), name
    peaks = {name: r["records"][-1]["peak_activation_bytes"]
             for name, r in zip([*SCHEDULES, *variants], results, strict=True)}  # fmt: skip
    assert peaks["full"] < peaks["selective"] < peaks["dualpipev"], peaks
    # every MoE layer's routing is in the log, DualPipe's two copies of each added up
    for record in watched["records"]:
        assert set(record["expert_load"]) == {"layers.1.mlp", "layers.2.mlp", "layers.3.mlp"}
        assert all(load >= 1.0 for load in record["expert_load"].values())
        assert record["balance_loss"] > 0 and record["dropped"] > 0
    assert all(r["dropped"] == 0 for r in results[0]["records"])  # no capacity: nothing dropped


@pytest.mark.timeout(600)
def test_an_expert_parallel_checkpoint_reloads_into_other_layouts_and_exports_whole(
    model_file, tmp_path
):
    """PP2 x EP2 saves after steps 2 and 3: the export of step 3 holds every expert of the whole
    model, under its names, and PP4 x EP1 and PP1 x EP4 load step 3 bit for bit; one process
    resumes from step 2 and its step 3 follows the expert-parallel run's."""
    import shutil

    import torch

    from cutpipe.models import language_model, load_model_config
    from cutpipe.train.checkpoint import POINTER, export_checkpoint, step_folder

    folder = tmp_path / "ckpt"
    saved = options(model_file, "dualpipev", ep=2, checkpoint_dir=str(folder), checkpoint_every=2)
    # the same checkpoint loaded into PP 4 x EP 1 and PP 1 x EP 4 by the same processes
    layouts = [
        options(model_file, "1f1b", microbatches=4, checkpoint_dir=str(folder), resume=True),
        options(model_file, "1f1b", ep=4, microbatches=2, checkpoint_dir=str(folder), resume=True),
    ]
    calls = [("train_rank", (saved,)), ("loaded_parameters", (layouts,))]
    ranks = run(workers.in_turn, 4, (calls,), timeout=400)
    first = ranks[0][0]
    exported = tmp_path / "model.pt"
    export_checkpoint(folder, exported)  # step 3, written by the four expert-parallel ranks
    state = torch.load(exported)
    whole = language_model(load_model_config(Path(model_file))).state_dict()
    assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in whole.items()}
    # every parameter of both layouts bit for bit
    parameters = set(dict(language_model(load_model_config(Path(model_file))).named_parameters()))
    for layout in zip(*(held for _, held in ranks), strict=True):
        seen = set()
        for held in layout:  # every rank's parameters
            for name, value in held.items():
                assert torch.equal(value, state[name]), name
            seen |= set(held)
        assert seen == parameters  # between them the ranks hold the whole model
    shutil.rmtree(step_folder(folder, 3))  # back to step 2
    (folder / POINTER).write_text(step_folder(folder, 2).name)
    again = options(model_file, "1f1b", microbatches=4, checkpoint_dir=str(folder), resume=True)
    resumed = run(workers.train_rank, 1, (again,), timeout=300)[0]
    assert resumed["resumed_from"] == 2
    assert resumed["losses"] == pytest.approx(first["losses"][2:], rel=1e-5)


#: the runtime's own PP x EP (x DP) layouts on 8 processes (moe_workers.several_layouts), each
#: against the model without expert parallelism: PP 4 x EP 2, and PP 2 x EP 2 x DP 2
LAYOUTS = [
    ((4, 2, 1), [("dualpipev", 7, "sum", True)]),
    ((2, 2, 2), [("dualpipev", 4, "mean", True), ("1f1b", 4, "sum", True)]),
]


@pytest.fixture(scope="module")
def eight_processes(model_file: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The one 8-process launch of the suite (8 workers start slowly on a small machine): the
    trainer's PP 2 x EP 2 x DP 2 runs with ZeRO-1 and with FSDP (its checkpoint in ``folder``),
    then the runtime's layouts; rank 0's runs, every rank's layouts."""
    folder = tmp_path_factory.mktemp("eight") / "ckpt"
    runs = [
        options(model_file, "dualpipev", ep=2, dp=2, dp_mode="zero1", microbatches=4),
        options(model_file, "dualpipev", ep=2, dp=2, dp_mode="fsdp", microbatches=4,
                checkpoint_dir=str(folder)),
    ]  # fmt: skip
    calls = [("train_runs", (runs,)), ("moe_layouts", (LAYOUTS,))]
    ranks = run(workers.in_turn, 8, (calls,), timeout=560)
    return {"folder": folder, "runs": ranks[0][0], "layouts": [rank[1] for rank in ranks]}


@pytest.mark.timeout(600)
def test_pp2_x_ep2_x_dp2_on_eight_processes_follows_one_process(
    model_file, reference, eight_processes, tmp_path
):
    """DP replicas of the expert-parallel pipelines (experts averaged over DP, the rest over
    DP x EP), with ZeRO-1's sharded AdamW over the replicas that hold the same experts, and with
    FSDP (experts sharded over their DP replicas, the rest over all DP x EP replicas), whose
    sharded checkpoint exports the whole model."""
    import torch

    from cutpipe.models import language_model, load_model_config
    from cutpipe.train.checkpoint import export_checkpoint

    export_checkpoint(eight_processes["folder"], tmp_path / "model.pt")
    state = torch.load(tmp_path / "model.pt")
    whole = language_model(load_model_config(Path(model_file))).state_dict()
    assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in whole.items()}
    for mode, result in zip(("zero1", "fsdp"), eight_processes["runs"], strict=True):
        assert result["losses"] == pytest.approx(reference["losses"], rel=1e-5), mode
        norms = [r["grad_norm"] for r in result["records"]]
        wanted = [r["grad_norm"] for r in reference["records"]]
        assert norms == pytest.approx(wanted, rel=1e-5), mode


@pytest.mark.timeout(600)
def test_eight_processes_as_pp4_x_ep2_and_pp2_x_ep2_x_dp2(eight_processes):
    """The runtime itself (tests/test_moe.py's meshes), every rank at its own place in each."""
    ranks = eight_processes["layouts"]
    for layout, width in ((0, 4), (1, 2)):
        coordinates = {rank[layout][0]["coordinate"] for rank in ranks}
        assert len(coordinates) == 8  # every rank has its own place in the mesh
        assert {c[0] for c in coordinates} == set(range(width))
    for rank in ranks:
        for layout in rank:
            for result in layout:
                case = result["case"]
                assert result["loss"] == pytest.approx(result["expected"], rel=1e-6), case
                assert result["grad_error"] <= 1e-6, case
