"""Validation during training (docs/training.md, "Validation"): the pipelined held-out loss
equals one process's on the same windows, evaluation moves nothing of the training, the
held-out tokens are never trained on, every evaluation reads the same windows, and bad input is
one line with exit status 2 before any process starts."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from pathlib import Path

import eval_workers as workers
import pytest
import torch
import torch.nn.functional as F

from cutpipe.cli.main import main
from cutpipe.cli.train import summary
from cutpipe.data import Tokens
from cutpipe.data.heldout import DEFAULT_STEPS, HeldOutBatches
from cutpipe.launch import run
from cutpipe.train.evaluate import Evaluator, cross_entropy_only
from cutpipe.train.metrics import MetricsLog, read_metrics
from cutpipe.train.options import TrainOptions
from cutpipe.train.tasks import task_for
from cutpipe.train.trainer import StepRecord

DENSE = """\
name: eval-lm
layers: 2
hidden: 32
heads: 2
ffn: 64
vocab: 256
seq_len: 16
microbatch_size: 2
dtype: fp32
"""
MOE = """\
name: eval-moe
layers: 3
hidden: 32
heads: 2
ffn: 32
experts: 4
top_k: 2
dense_layers: 1
dense_ffn: 64
vocab: 256
seq_len: 16
microbatch_size: 2
dtype: fp32
"""


def words(count: int, seed: int) -> str:
    """Text of ``count`` words drawn from a small vocabulary (a model can learn something)."""
    pick = random.Random(seed)
    vocabulary = ["pipe", "stage", "bubble", "rank", "schedule", "the", "a", "of", "runs", "on"]
    return " ".join(pick.choice(vocabulary) for _ in range(count)) + "\n"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("eval")
    made = {
        "dense.yaml": DENSE,
        "moe.yaml": MOE,
        "train.txt": words(6000, 1),
        "val.txt": words(900, 2),
    }
    made["tiny.txt"] = "too short for a batch\n"
    for name, text in made.items():
        (folder / name).write_text(text)
    return {Path(name).stem: str(folder / name) for name in made}


@pytest.fixture(scope="module", autouse=True)
def one_thread_per_worker() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        yield


def options(files: dict[str, str], **changes) -> TrainOptions:
    settings = dict(model=files["dense"], data=[files["train"]], schedule="dualpipev", steps=3,
                    microbatches=4, global_batch=8, quiet=True, eval_steps=3)  # fmt: skip
    return TrainOptions.build(**{**settings, **changes})


# -- one launch: 2 gloo ranks ---------------------------------------------------------------------

#: Evaluated around two training steps: DualPipeV (PP 2), data parallelism (1F1B on PP 1 x DP 2,
#: all-reduce and FSDP2), an MoE with DeepSeek-style balancing (1F1B on PP 2), and the MoE's
#: experts spread over 2 ranks (EP 2: its stages run as phases around all-to-alls).
CHECKS = {
    "dualpipev": dict(val_fraction=0.1),
    "dp": dict(schedule="1f1b", dp=2, val_data=["VAL"]),
    "fsdp": dict(schedule="1f1b", dp=2, dp_mode="fsdp", val_data=["VAL"]),
    "moe": dict(model="MOE", schedule="1f1b", val_fraction=0.1, routing_bias_rate=0.01),
    "ep": dict(model="MOE", schedule="1f1b", ep=2, val_fraction=0.1),
}


def check_options(files: dict[str, str], name: str) -> TrainOptions:
    changes = dict(CHECKS[name])
    if "val_data" in changes:
        changes["val_data"] = [files["val"]]
    if changes.get("model") == "MOE":
        changes["model"] = files["moe"]
    return options(files, **changes)


@pytest.fixture(scope="module")
def launched(files, tmp_path_factory) -> dict:
    """Every multi-process check of the module in one launch of 2 ranks."""
    logs = tmp_path_factory.mktemp("logs")
    checks = [check_options(files, name) for name in CHECKS]
    kept = dict(val_data=[files["val"]], checkpoint_dir=str(logs / "checkpoints"))
    runs = [
        options(files, eval_every=2, log=str(logs / "eval.jsonl"), **kept),
        options(files, eval_steps=None),  # the same training, never evaluated
        options(files, eval_every=0, steps=4, resume=True, **kept),  # one step more, no evaluation
        options(files, val_data=[files["val"]], eval_every=2, step_boundary="overlap"),
    ]
    per_rank = run(workers.eval_launch, 2, (checks, runs), timeout=400)
    _, trained = per_rank[0]
    return {
        "checks": dict(zip(CHECKS, zip(*(rank[0] for rank in per_rank), strict=True), strict=True)),
        "runs": trained,
        "log": logs / "eval.jsonl",
    }


def reference_loss(settings: TrainOptions, weights: dict[str, torch.Tensor] | None) -> float:
    """One process's held-out loss: the whole model (at its first weights, or ``weights``) on
    the validation windows, cross entropy averaged over each batch, then over the batches."""
    task = task_for(settings)
    task.loader(settings.global_batch, settings.seed)
    model = task.build(settings.seed)
    if weights is not None:
        model.load_state_dict(weights)
    batches = HeldOutBatches(task.validation(), task.tokens_per_sample, settings.global_batch,
                             settings.eval_steps)  # fmt: skip
    with torch.no_grad():
        losses = [
            F.cross_entropy(model(inputs)[0].reshape(-1, 256), targets.reshape(-1))
            for inputs, targets in batches
        ]
    return float(torch.stack(losses).double().mean())


@pytest.mark.timeout(500)
@pytest.mark.parametrize("name", list(CHECKS))
def test_the_pipelined_held_out_loss_is_one_process_loss(files, launched, name):
    """At the first weights and after two steps, on every rank, within 1e-5 (the MoE's without
    its balancing term); twice at the same weights: the same value, bit for bit. The measured
    timeline stays the last training step's."""
    settings = check_options(files, name)
    ranks = launched["checks"][name]
    first = reference_loss(settings, None)
    for rank in ranks:
        assert rank["at_start"][0] == rank["at_start"][1] == ranks[0]["at_start"][0]
        assert rank["after"] == ranks[0]["after"]
        assert rank["at_start"][0] == pytest.approx(first, rel=1e-5, abs=1e-6)
    weights = {k: torch.tensor(v) for rank in ranks for k, v in rank["weights"].items()}
    after = reference_loss(settings, weights)
    assert abs(after - first) > 1e-3  # the steps moved the weights: the check can fail
    assert ranks[0]["after"] == pytest.approx(after, rel=1e-5, abs=1e-6)
    # gathered on each pipeline's first rank
    assert ranks[0]["same_timeline"] is True and ranks[1]["same_timeline"] in (True, None)


@pytest.mark.timeout(500)
def test_evaluation_counts_no_routing_and_moves_no_bias(files, launched):
    """An MoE's tallies and balancing bias: untouched by evaluations, moved by training."""
    for rank in launched["checks"]["moe"]:
        start, trained, evaluated = rank["routing"]
        assert start["microbatches"] == 0 and start["pending"] == 0
        assert all(not any(bias) for bias in start["bias"].values())
        # the steps counted and moved the bias (read and reset by each step's statistics)
        assert any(any(bias) for bias in trained["bias"].values())
        assert evaluated["microbatches"] == 0 and evaluated["pending"] == 0
        for layer, bias in trained["bias"].items():
            assert evaluated["bias"][layer] == bias


@pytest.mark.timeout(500)
def test_a_run_evaluates_where_asked_and_trains_as_it_would_without(files, launched):
    """``--eval-every 2`` over 3 steps: after steps 2 and 3 (the log's records carry it, no
    other record does, and the summary line says the last); the training losses are bitwise
    those of the run never evaluated."""
    evaluated, plain, _, overlapped = launched["runs"]
    assert evaluated["losses"] == plain["losses"]
    records = read_metrics(launched["log"])
    assert [r["step"] for r in records] == [1, 2, 3]
    assert ["val_loss" in r for r in records] == [False, True, True]
    for record in records[1:]:
        assert record["val_ppl"] == pytest.approx(math.exp(record["val_loss"]))
        assert record["val_time"] > 0
    last = records[-1]
    fields = {k: last[k] for k in ("val_loss", "val_ppl")}
    assert evaluated["validation"] == {"step": 3, **fields}
    assert plain["validation"] is None
    said = f"validation loss {last['val_loss']:.4f} (perplexity {last['val_ppl']:.2f}) after step 3"
    assert said in summary(evaluated)
    # steps that overlap their boundary: the record of an evaluated step still gets its loss
    held_out = [r.get("val_loss") for r in overlapped["records"]]
    assert held_out[0] is None
    assert held_out[1:] == pytest.approx([r["val_loss"] for r in records[1:]], rel=1e-5)


@pytest.mark.timeout(500)
def test_checkpoints_keep_the_latest_validation_loss(launched):
    """A run resumed from the evaluated run's last checkpoint (step 3), told never to evaluate,
    reports the validation loss that checkpoint kept, and keeps it in its own."""
    evaluated, _, resumed, _ = launched["runs"]
    assert resumed["resumed_from"] == 3 and [r["step"] for r in resumed["records"]] == [4]
    assert "val_loss" not in resumed["records"][0]
    assert resumed["validation"] == evaluated["validation"]
    assert "after step 3" in summary(resumed)


# -- in one process ------------------------------------------------------------------------------


def test_val_fraction_trains_on_the_rest_only(files):
    """The training loader reads the first 90% of the tokens and the validation set the last
    10%: together the whole corpus, with no token in both."""
    task = task_for(options(files, val_fraction=0.1))
    loader = task.loader(8, 0)
    whole = Path(files["train"]).read_bytes()
    trained, held = loader.tokens.values, task.validation().values
    assert len(held) == int(len(whole) * 0.1) and len(trained) + len(held) == len(whole)
    assert bytes(trained.tolist()) + bytes(held.tolist()) == whole
    assert trained.data_ptr() + len(trained) <= held.data_ptr()  # disjoint parts of one buffer
    seen = torch.cat([next(loader)[1].flatten() for _ in range(loader.batches_per_epoch)])
    assert len(seen) == loader.batches_per_epoch * 8 * 16
    assert loader.tokens.fingerprint != Tokens.from_bytes(whole).fingerprint


def test_every_evaluation_reads_the_same_windows_in_order():
    values = torch.arange(200, dtype=torch.uint8)
    batches = HeldOutBatches(Tokens.from_tensor(values), seq_len=4, batch=3, steps=2)
    first, second = list(batches), list(batches)
    for (a, b), (c, d) in zip(first, second, strict=True):
        assert torch.equal(a, c) and torch.equal(b, d)
    inputs, targets = first[1]  # windows 3, 4, 5: tokens from 12, 16, 20, consecutive
    assert inputs.tolist() == [[12, 13, 14, 15], [16, 17, 18, 19], [20, 21, 22, 23]]
    assert targets.tolist() == [[13, 14, 15, 16], [17, 18, 19, 20], [21, 22, 23, 24]]
    # by default all of a small set, at most DEFAULT_STEPS batches
    assert len(HeldOutBatches(Tokens.from_tensor(values), 4, 3)) == min(DEFAULT_STEPS, 49 // 3)
    assert len(HeldOutBatches(Tokens.from_tensor(values[:40]), 4, 3)) == 3


def test_a_held_out_share_outside_0_to_1_is_refused_in_code():
    for share in (0.0, 1.0, -0.5, math.nan):
        with pytest.raises(ValueError, match="the share of the tokens held out: give one between"):
            TrainOptions.build(val_fraction=share)


def test_evaluations_come_where_asked():
    batches = HeldOutBatches(Tokens.from_tensor(torch.zeros(100, dtype=torch.uint8)), 4, 2)
    due = {every: [s for s in range(1, 8) if Evaluator(batches, every, 7).due(s)]
           for every in (None, 0, 3)}  # fmt: skip
    assert due == {None: [7], 0: [], 3: [3, 6, 7]}


def test_the_balancing_term_is_left_out_while_evaluating():
    from cutpipe.models.transformer import LanguageModelLoss

    loss = LanguageModelLoss(aux_weight=0.5)
    logits, targets, aux = torch.zeros(4, 256), torch.zeros(4, dtype=torch.long), torch.tensor(2.0)
    with cross_entropy_only(loss):
        assert float(loss((logits, aux), targets)) == pytest.approx(math.log(256))
    assert float(loss((logits, aux), targets)) == pytest.approx(math.log(256) + 1.0)


def test_the_log_writes_validation_fields_only_where_evaluated(tmp_path):
    base = dict(step=1, loss=2.0, lr=1e-3, grad_norm=1.0, tokens_per_s=10.0, step_time=0.1,
                bubble=None, peak_activation_bytes=0)  # fmt: skip
    log = MetricsLog(str(tmp_path / "m.jsonl"))
    log.write(StepRecord(**base))
    log.write(StepRecord(**{**base, "step": 2}, val_loss=1.5, val_ppl=math.exp(1.5), val_time=0.2))
    log.close()
    first, second = (json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines())
    assert "val_loss" not in first and second["val_loss"] == 1.5


def test_the_loss_picture_draws_the_validation_curve(tmp_path):
    from cutpipe.viz.curve import save_loss_curves

    records = [{"step": s, "loss": 3.0 - 0.1 * s} for s in range(1, 7)]
    for record in records[1::2]:
        record["val_loss"] = record["loss"] + 0.2
    drawn = {}
    for name, runs in (("with", records), ("without", [dict(r) for r in records])):
        if name == "without":
            for record in runs:
                record.pop("val_loss", None)
        path = tmp_path / f"{name}.svg"
        save_loss_curves({"run": runs}, path)
        drawn[name] = path.read_text()
    assert "run (validation)" in drawn["with"] and "run (validation)" not in drawn["without"]


# -- bad input: one line, exit status 2, before any process ---------------------------------------

BAD = [
    (["--val-data", "VAL", "--val-fraction", "0.1"], "--val-data and --val-fraction both give"),
    (["--eval-every", "5"], "--eval-every needs a validation set: give --val-data or"),
    (
        ["--val-fraction", "1"],
        "--val-fraction: expected a share between 0 and 1, e.g. 0.05, got '1'",
    ),
    (["--val-fraction", "nan"], "--val-fraction: expected a share between 0 and 1"),
    (
        ["--val-data", "TINY"],
        "holds 22 tokens, 1 window of 17 tokens, fewer than one global batch (8 windows)",
    ),
    (
        ["--val-data", "VAL", "--eval-steps", "40"],
        "holds 273 windows of 17 tokens, 34 global batches of 8, fewer than --eval-steps 40",
    ),
    (
        ["--val-fraction", "0.002"],
        "the held-out 0.002 of TRAIN holds 58 tokens, 3 windows of 17 "
        "tokens, fewer than one global batch (8 windows)",
    ),
    (["--model", "mlp", "--val-fraction", "0.1"], "the example MLP, which trains on fresh"),
]


@pytest.mark.parametrize(("given", "said"), BAD, ids=[b[1][:24] for b in BAD])
def test_bad_validation_input_is_one_line_and_status_2(files, capsys, given, said):
    given = [{"VAL": files["val"], "TINY": files["tiny"]}.get(g, g) for g in given]
    model = [] if "--model" in given else ["--model", files["dense"], "--data", files["train"]]
    args = ["train", "--nproc", "2", "-s", "1f1b", "-m", "4", "--global-batch", "8", *model, *given]
    code = main(args)
    _, err = capsys.readouterr()
    assert code == 2
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert said.replace("TRAIN", files["train"]) in err, err
