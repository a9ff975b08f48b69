"""The B/W split, recompute and a training run on every device this machine has: the CPU always,
CUDA where there is one (skipped otherwise; ``scripts/gpu_check.sh`` runs this file on a GPU).

Each test checks against plain autograd on the same device, so the CUDA runs need no reference
numbers of their own."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

from cutpipe.models.transformer import Layer
from cutpipe.runtime.compute.deferral import WeightGradients, WeightSplitter
from cutpipe.runtime.compute.recompute import apply_recompute
from cutpipe.runtime.stages import Chain
from cutpipe.spec import ModelSpec

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ),
]
SPEC = ModelSpec(name="t", layers=2, hidden=64, heads=4, ffn=128, vocab=256, seq_len=32)


def layers(device: str) -> Chain:
    torch.manual_seed(0)
    return Chain(*(Layer(SPEC, i) for i in range(SPEC.layers))).to(device)


def split_gradients(model: Chain, x: torch.Tensor, dtype: torch.dtype | None) -> dict:
    """Forward with the weight gradients deferred, B, then W: every parameter's gradient."""
    splitter = WeightSplitter(model)
    gradients = WeightGradients()
    gradients.defer = True
    autocast = torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None)
    with splitter.deferring(gradients), autocast:
        out, aux = model(x, torch.zeros((), device=x.device))
    (out.float().pow(2).mean() + aux).backward()
    assert all(layer.weight.grad is None for layer in splitter._layers), "W ran during B"
    gradients.run()
    splitter.close()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def plain_gradients(model: Chain, x: torch.Tensor, dtype: torch.dtype | None) -> dict:
    with torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None):
        out, aux = model(x, torch.zeros((), device=x.device))
    (out.float().pow(2).mean() + aux).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("dtype", "tolerance"), [(None, 1e-5), (torch.bfloat16, 2e-2)])
def test_the_bw_split_equals_autograd(device, dtype, tolerance):
    x = torch.randn(2, SPEC.seq_len, SPEC.hidden, device=device)
    model = layers(device)
    want = plain_gradients(copy.deepcopy(model), x, dtype)
    got = split_gradients(model, x, dtype)
    for name, grad in want.items():
        assert got[name].dtype == torch.float32, name  # fp32 master weights keep fp32 grads
        scale = grad.abs().max().clamp_min(1e-12)
        assert float((got[name] - grad).abs().max() / scale) <= tolerance, name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_under_the_split_equals_autograd(device, mode):
    x = torch.randn(2, SPEC.seq_len, SPEC.hidden, device=device)
    model = layers(device)
    want = plain_gradients(copy.deepcopy(model), x, None)
    recompute = apply_recompute(model, mode, units=Layer)
    got = split_gradients(model, x, None)
    recompute.close()
    for name, grad in want.items():
        assert torch.allclose(got[name], grad, rtol=1e-5, atol=1e-7), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.timeout(300)
def test_cutpipe_trains_on_one_gpu_with_nccl(tmp_path):
    model = tmp_path / "model.yaml"
    model.write_text(
        "name: g\nlayers: 4\nhidden: 64\nheads: 4\nffn: 128\nvocab: 256\nseq_len: 64\n"
        "microbatch_size: 2\ndtype: bf16\n"
    )
    command = [sys.executable, "-m", "cutpipe", "train", "--quiet", "--model", str(model),
               "--schedule", "1f1b", "--nproc", "1", "--backend", "nccl", "--steps", "20",
               "--dtype", "bf16", "--recompute", "full"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=280,
                            env={**os.environ, "OMP_NUM_THREADS": "4"})  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    first, last = (
        float(v) for v in result.stdout.split("loss ")[1].split(" nats")[0].split(" -> ")
    )
    assert last < first
