"""The ``fsdp`` data-parallel mode (FSDP2 on each stage, ``cutpipe.parallel.fsdp``) on gloo: PP 2 x
DP 2 trains exactly as one process on the whole batch, with the B/W split and DualPipe's
mirrored copies, and holds the memory its docs say."""

import fsdp_workers as workers
import pytest
from torch import nn

from cutpipe.launch import run
from cutpipe.parallel.fsdp import FsdpReducer, shard_stages

Case = workers.Case
CASES = [
    Case("dualpipev", 4),
    Case("zbv", 4),
    Case("zbv", 4, reshard_after_forward=True),  # all-gathered for every B; W on the shards
    Case("zbv", 4, per_block=False),  # one FSDP group per stage
    Case("zbv", 4, "transformer"),  # norms and the embedding get their gradients in B
    Case("dualpipe", 4),  # reduced in the step, then the copies' shards summed
    Case("dualpipe", 4, in_runner=False),  # copies summed whole by the runner, then reduced
    Case("zbv", 4, in_runner=False),  # the same reduction, driven from outside the step
]


@pytest.fixture(scope="module")
def results():
    ranks = run(workers.training, 4, (CASES,), timeout=150)
    return [{r["case"]: r for r in rank} for rank in ranks]


@pytest.mark.timeout(180)
def test_pp2_dp2_fsdp_trains_as_one_process(results):
    for by_case in results:
        for case, result in by_case.items():
            print(case, {k: v for k, v in result.items() if k != "case"})
            assert result["sharded"], case  # DTensor shards before, and after an evaluation
            assert result["grad_error"] <= 1e-6, case  # full gradients, mean over the batch
            assert result["param_error"] <= 1e-6, case  # after 3 AdamW steps
            assert result["loss_error"] <= 1e-6, case
            assert result["moved"] >= 1e-3, case  # 1000 times the tolerance


@pytest.mark.timeout(180)
def test_fsdp_memory_per_rank(results):
    """Between steps a rank holds 1/DP of its parameters, gradients and AdamW's two moments;
    before the reduction also its stages' unsharded parameters and gradients."""
    for by_case in results:
        for case, result in by_case.items():
            if "in_runner=False" in case:
                full = result["full_bytes"]
                assert result["between_bytes"] == full * (1 + 1 + 2) // 2, case
                assert result["during_bytes"] == full * (1 + 1) + full * (1 + 2) // 2, case


def test_reducer_takes_sharded_stages_only():
    with pytest.raises(TypeError, match="stage 3 is not sharded"):
        FsdpReducer({3: nn.Linear(2, 2)})


def test_shard_stages_takes_the_dp_mesh():
    class Mesh2D:
        ndim = 2

    with pytest.raises(ValueError, match="1-D data-parallel mesh"):
        shard_stages({0: nn.Linear(2, 2)}, Mesh2D())
