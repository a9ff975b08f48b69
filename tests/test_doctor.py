"""``cutpipe doctor``: the checks on described machines, and the command on this one."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import replace

import pytest

from cutpipe.cli.main import main
from cutpipe.doctor import gathering
from cutpipe.doctor.findings import ADVICE, OK, UNCHECKED, WARNING, Finding
from cutpipe.doctor.gathering import (
    Machine,
    gather,
    nodes_of,
    read_infiniband,
    read_modules,
    read_nccl_conf,
)
from cutpipe.doctor.report import diagnose, startup_warnings, warning_lines

GPU_CHECKS = ("CUDA", "GPUs", "NCCL", "bf16", "CUDA graphs", "NCCL P2P")
NAMES = [
    "torch",
    "CUDA",
    "GPUs",
    "NCCL",
    "bf16",
    "CUDA graphs",
    "allocator",
    "NCCL P2P",
    "NCCL channels",
    "network transport",
    "GPUDirect RDMA",
    "NCCL socket threads",
]
WELL_SET = {
    "PYTORCH_ALLOC_CONF": "expandable_segments:True",
    "NCCL_MIN_NCHANNELS": "16",  # twice the 8 GPUs
    "NCCL_SOCKET_NTHREADS": "4",
    "NCCL_NSOCKS_PERTHREAD": "4",
}


def gpu_node(**changes) -> Machine:
    """A GPU node as the issue describes it: bf16, NCCL 2.21, nothing set, sockets only."""
    machine = Machine(
        node="gpu-node-1",
        environ={},
        torch_version="2.13.0+cu128",
        cuda_version="12.8",
        gpus=8,
        gpu_name="NVIDIA H100 80GB HBM3",
        capability=(9, 0),
        nccl_version=(2, 21, 5),
        bf16=True,
        cuda_graphs=True,
        peer_access=True,
        modules=frozenset({"nvidia", "nvidia_uvm"}),
        infiniband=(),
        kernel="6.8.0-45-generic",
    )
    return replace(machine, **changes)


def by_name(findings: list[Finding]) -> dict[str, Finding]:
    return {finding.name: finding for finding in findings}


def run(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


# --- described machines --------------------------------------------------------------------


def test_a_bare_gpu_node_gets_the_three_recommendations_and_nothing_unchecked():
    found = by_name(diagnose(gpu_node()))
    assert list(found) == NAMES
    assert [f.name for f in found.values() if f.status == UNCHECKED] == []
    assert [f.name for f in found.values() if f.status == WARNING] == []
    advised = {f.name: f.advice for f in found.values() if f.status == ADVICE}
    assert set(advised) == {"allocator", "NCCL channels", "NCCL socket threads"}
    assert "PYTORCH_ALLOC_CONF=expandable_segments:True" in advised["allocator"]
    assert "NCCL_MIN_NCHANNELS=16" in advised["NCCL channels"]  # twice the 8 GPUs
    assert "NCCL_SOCKET_NTHREADS=4" in advised["NCCL socket threads"]
    assert found["NCCL"].value == "2.21.5" and found["bf16"].status == OK
    assert found["GPUs"].value == "8 x NVIDIA H100 80GB HBM3, compute capability 9.0"
    assert all(f.why.endswith(".") and f.why.count(". ") == 0 for f in found.values())
    lines = warning_lines(list(found.values()))
    assert len(lines) == 3 and all(line.startswith("advice: ") for line in lines)


@pytest.mark.parametrize(
    "changes",
    [
        {"environ": WELL_SET},
        {
            "environ": {**WELL_SET, "NCCL_SOCKET_NTHREADS": "1", "NCCL_NSOCKS_PERTHREAD": "1"},
            "infiniband": ("mlx5_0", "mlx5_1"),
            "modules": frozenset({"nvidia", "nvidia_peermem"}),
        },
        {"environ": {"NCCL_MIN_NCHANNELS": "4", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, "nodes": 1, "gpus": 2},
    ],
    ids=["sockets", "infiniband", "one-node"],
)  # fmt: skip
def test_a_well_set_node_is_ok_everywhere(changes):
    findings = diagnose(gpu_node(**changes))
    assert {f.name: f.status for f in findings} == dict.fromkeys(NAMES, OK)
    assert warning_lines(findings) == []


def finding(name: str, **changes) -> Finding:
    return by_name(diagnose(gpu_node(**changes)))[name]


@pytest.mark.parametrize(
    ("name", "changes", "status", "says"),
    [
        ("NCCL P2P", {"environ": {"NCCL_P2P_DISABLE": "1"}}, WARNING, "unset NCCL_P2P_DISABLE"),
        ("NCCL P2P", {"environ": {"NCCL_P2P_LEVEL": "LOC"}}, WARNING, "unset NCCL_P2P_LEVEL"),
        ("NCCL P2P", {"environ": {"NCCL_P2P_DISABLE": "0"}}, OK, ""),
        ("NCCL P2P", {"peer_access": False}, ADVICE, "nvidia-smi topo -m"),
        ("NCCL P2P", {"gpus": 1, "peer_access": None}, OK, ""),
        ("NCCL channels", {"environ": {"NCCL_MIN_NCHANNELS": "8"}}, ADVICE, "NCCL_MIN_NCHANNELS=16"),
        ("NCCL channels", {"environ": {"NCCL_MIN_NCHANNELS": "2"}, "gpus": 1}, ADVICE,
         "NCCL_MIN_NCHANNELS=4"),
        ("NCCL channels", {"environ": {"NCCL_MIN_NCHANNELS": "many"}}, WARNING, "whole number"),
        ("NCCL channels", {"environ": {"NCCL_MIN_NCHANNELS": "8", "NCCL_MAX_NCHANNELS": "2"}},
         ADVICE, "NCCL_MAX_NCHANNELS"),
        ("NCCL socket threads", {"environ": {"NCCL_SOCKET_NTHREADS": "16", "NCCL_NSOCKS_PERTHREAD": "8"}},
         WARNING, "at most 64"),
        ("NCCL socket threads", {"environ": {"NCCL_SOCKET_NTHREADS": "2"}}, ADVICE, "NCCL_NSOCKS"),
        ("NCCL socket threads", {"environ": {"NCCL_SOCKET_NTHREADS": "x"}}, WARNING, "whole numbers"),
        ("NCCL socket threads", {"environ": {"NCCL_NSOCKS_PERTHREAD": "4"}}, OK, ""),
        ("network transport", {"infiniband": ("mlx5_0",), "environ": {"NCCL_IB_DISABLE": "1"}},
         WARNING, "NCCL_IB_DISABLE"),
        ("network transport", {"infiniband": ("mlx5_0",), "environ": {"NCCL_NET": "Socket"}},
         WARNING, "NCCL_NET"),
        ("network transport", {"infiniband": None}, UNCHECKED, "Linux"),
        ("NCCL socket threads", {"infiniband": ("mlx5_0",), "environ": {"NCCL_IB_DISABLE": "1"}},
         ADVICE, "NCCL_SOCKET_NTHREADS=4"),
        ("GPUDirect RDMA", {"infiniband": ("mlx5_0",)}, ADVICE, "modprobe nvidia-peermem"),
        ("GPUDirect RDMA", {"infiniband": ("mlx5_0",), "kernel": "5.4.0-150-generic"}, WARNING,
         "modprobe nvidia-peermem"),
        ("GPUDirect RDMA", {"infiniband": ("mlx5_0",), "modules": frozenset({"nv_peer_mem"})}, OK, ""),
        ("GPUDirect RDMA", {"infiniband": ("mlx5_0",), "modules": frozenset({"nvidia_peermem"}),
                            "environ": {"NCCL_NET_GDR_LEVEL": "LOC"}}, WARNING, "NCCL_NET_GDR_LEVEL"),
        ("GPUDirect RDMA", {"infiniband": ("mlx5_0",), "modules": None}, UNCHECKED, "/proc/modules"),
        ("allocator", {"environ": {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}}, ADVICE,
         "add expandable_segments:True to PYTORCH_ALLOC_CONF"),
        ("allocator", {"environ": {"PYTORCH_ALLOC_CONF": "expandable_segments:yes"}}, WARNING,
         "expandable_segments:True"),
        ("allocator", {"environ": {"PYTORCH_ALLOC_CONF": "max_split_size_mb:512"}}, ADVICE,
         "add expandable_segments:True"),
        ("allocator", {"environ": {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}}, OK, ""),
        ("allocator", {"environ": {"PYTORCH_ALLOC_CONF": "expandable_segments:True",
                                   "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}},
         WARNING, "keep only PYTORCH_ALLOC_CONF"),
        ("allocator", {"torch_version": "2.9.1+cu128",
                       "environ": {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}},
         WARNING, "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True instead"),
        ("allocator", {"torch_version": "2.9.1+cu128",
                       "environ": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}, OK, ""),
        ("allocator", {"torch_version": "2.4.0"}, ADVICE,
         "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"),
        ("bf16", {"bf16": False, "capability": (7, 0)}, ADVICE, "--dtype fp32"),
        ("CUDA graphs", {"cuda_graphs": False, "cuda_graphs_error": "RuntimeError: boom"}, ADVICE,
         "eagerly"),
        ("NCCL", {"nccl_version": None}, WARNING, "--backend gloo"),
    ],
)  # fmt: skip
def test_each_check_says_what_to_do(name, changes, status, says):
    found = finding(name, **changes)
    assert found.status == status, found
    assert says in found.advice + found.value + found.why, found
    assert found.why


def test_nccl_settings_come_from_the_environment_before_nccls_files():
    files = (("/home/me/.nccl.conf", {"NCCL_MIN_NCHANNELS": "16"}),
             ("/etc/nccl.conf", {"NCCL_MIN_NCHANNELS": "1", "NCCL_SOCKET_NTHREADS": "4",
                                 "NCCL_NSOCKS_PERTHREAD": "2"}))  # fmt: skip
    channels = finding("NCCL channels", nccl_files=files)
    assert channels.status == OK and "(in /home/me/.nccl.conf)" in channels.value
    assert finding("NCCL socket threads", nccl_files=files).status == OK
    overridden = finding("NCCL channels", nccl_files=files, environ={"NCCL_MIN_NCHANNELS": "2"})
    assert overridden.status == ADVICE and overridden.value == "NCCL_MIN_NCHANNELS=2"


def test_without_a_gpu_every_gpu_check_is_unchecked_and_says_why():
    machine = Machine(
        torch_version="2.13.0+cpu", no_gpu="this torch (2.13.0+cpu) is a CPU build", infiniband=()
    )
    found = by_name(diagnose(machine))
    for name in GPU_CHECKS:
        assert found[name].status == UNCHECKED, found[name]
        assert "CPU build" in found[name].why
    assert found["torch"].status == OK
    assert found["allocator"].status == ADVICE  # the environment is still looked at
    no_torch = by_name(diagnose(Machine(no_gpu="torch does not import (ModuleNotFoundError)")))
    assert no_torch["torch"].status == WARNING and "pip install torch" in no_torch["torch"].advice


def test_finding_refuses_an_unknown_status():
    with pytest.raises(ValueError, match="status must be one of"):
        Finding("x", "y", "fine", "", "why.")


# --- gathering -----------------------------------------------------------------------------


def test_facts_from_files(tmp_path):
    modules = tmp_path / "modules"
    modules.write_text("nvidia_peermem 16384 0 - Live 0x0\nnvidia 5000 1 nvidia_peermem\n")
    assert read_modules(str(modules)) == {"nvidia_peermem", "nvidia"}
    assert read_modules(str(tmp_path / "none")) is None
    (tmp_path / "ib" / "mlx5_1").mkdir(parents=True)
    (tmp_path / "ib" / "mlx5_0").mkdir()
    assert read_infiniband(str(tmp_path / "ib")) == ("mlx5_0", "mlx5_1")
    conf = tmp_path / "nccl.conf"
    conf.write_text("# a comment\nNCCL_DEBUG=WARN\n NCCL_MIN_NCHANNELS = 8\nnot a setting\n")
    assert read_nccl_conf(str(conf)) == {"NCCL_DEBUG": "WARN", "NCCL_MIN_NCHANNELS": "8"}
    assert read_nccl_conf(str(tmp_path / "missing.conf")) == {}


def test_nodes_from_torchruns_variables():
    assert nodes_of({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}) == 2
    assert nodes_of({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}) == 1
    assert nodes_of({"WORLD_SIZE": "8"}) is None
    assert nodes_of({"WORLD_SIZE": "x", "LOCAL_WORLD_SIZE": "8"}) is None


def test_gather_keeps_only_the_variables_it_reads():
    machine = gather({"NCCL_MIN_NCHANNELS": "4", "HOME": "/root", "SECRET_TOKEN": "x"}, probe=False)
    assert dict(machine.environ) == {"NCCL_MIN_NCHANNELS": "4"}
    assert machine.node == socket.gethostname()
    assert machine.torch_version is not None


# --- the command ---------------------------------------------------------------------------


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def test_doctor_here_exits_0_and_says_what_it_could_not_check(capsys):
    code, out, err = run(capsys, "doctor", "--json")
    assert code == 0 and err == ""
    data = json.loads(out)
    assert set(data) == {"node", "findings", "counts"}
    assert [f["name"] for f in data["findings"]] == NAMES
    assert all(set(f) == {"name", "value", "status", "advice", "why"} for f in data["findings"])
    assert sum(data["counts"].values()) == len(NAMES)
    statuses = {f["name"]: f for f in data["findings"]}
    if _has_gpu():
        assert all(statuses[name]["status"] != UNCHECKED for name in GPU_CHECKS)
    else:
        for name in GPU_CHECKS:
            assert statuses[name]["status"] == UNCHECKED
            assert "it needs a GPU, and " in statuses[name]["why"]


def test_doctor_table_here():
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "CUTPIPE_DEBUG")}
    result = subprocess.run(
        [sys.executable, "-m", "cutpipe", "doctor"],
        capture_output=True, text=True, timeout=120, env={**env, "COLUMNS": "120"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    for word in ("check", "value", "status", "advice", *NAMES):
        assert word in result.stdout
    if not _has_gpu():
        assert "unchecked" in result.stdout and "No GPU here" in result.stdout


def test_doctor_on_a_described_gpu_node(capsys, monkeypatch):
    monkeypatch.setattr(gathering, "gather", lambda *a, **k: gpu_node())
    code, out, _ = run(capsys, "doctor", "--json")
    statuses = {f["name"]: f["status"] for f in json.loads(out)["findings"]}
    assert code == 0 and UNCHECKED not in statuses.values()
    code, out, _ = run(capsys, "doctor")
    assert code == 0 and "gpu-node-1" in out and "NCCL_MIN_NCHANNELS=16" in out
    assert "No GPU here" not in out


def test_under_torchrun_one_answer_per_node_prefixed_with_the_node(capsys, monkeypatch):
    monkeypatch.setattr(gathering, "gather", lambda *a, **k: gpu_node())
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert run(capsys, "doctor") == (0, "", "")
    assert run(capsys, "doctor", "--json") == (0, "", "")
    monkeypatch.setenv("LOCAL_RANK", "0")
    code, out, _ = run(capsys, "doctor")
    assert code == 0 and out and all(line.startswith("gpu-node-1: ") for line in out.splitlines())
    code, out, _ = run(capsys, "doctor", "--json")
    assert code == 0 and len(out.splitlines()) == 1 and json.loads(out)["node"] == "gpu-node-1"


def test_a_wrong_command_line_is_a_usage_error(capsys):
    code, _, err = run(capsys, "doctor", "--bogus")
    assert code == 2 and "cutpipe doctor: error: unrecognized arguments: --bogus" in err


# --- start-up warnings ---------------------------------------------------------------------


def test_startup_warnings_open_no_cuda_context_and_say_what_to_set(monkeypatch):
    seen = {}

    def fake_gather(environ=None, *, probe=True):
        seen["probe"] = probe
        return gpu_node(bf16=None, cuda_graphs=None, no_gpu="not probed")

    monkeypatch.setattr(gathering, "gather", fake_gather)
    lines = startup_warnings()
    assert seen["probe"] is False
    assert len(lines) == 3 and all(line.startswith("cutpipe doctor: advice: ") for line in lines)
    assert any("expandable_segments:True" in line for line in lines)
    one_node = startup_warnings(nodes=1)  # no network: no socket advice
    assert len(one_node) == 2 and not any("SOCKET" in line for line in one_node)


def test_startup_warnings_are_empty_without_a_gpu(monkeypatch):
    monkeypatch.setattr(gathering, "gather", lambda *a, **k: Machine(no_gpu="a CPU build"))
    assert startup_warnings() == []


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")  # torchelastic's, under capsys
def test_train_workers_print_the_doctors_warnings_once_per_node(monkeypatch, capsys):
    """On a GPU node, local rank 0 of a `cutpipe train` run says what the doctor advises before
    training; the other local ranks say nothing."""
    from pathlib import Path

    import cutpipe.cli.train as train_cli
    import cutpipe.launch.elastic as launch
    import cutpipe.train.trainer as trainer

    monkeypatch.setattr(gathering, "gather", lambda *a, **k: gpu_node())
    monkeypatch.setattr(trainer, "train", lambda options: {"rank": 0})
    monkeypatch.setattr(train_cli, "report", lambda result, options: None)
    monkeypatch.setattr(launch, "is_worker", lambda: True)
    model = Path(__file__).resolve().parents[1] / "examples/models/tiny-dense.yaml"
    args = ["train", "--model", str(model), "-s", "zbv"]
    monkeypatch.setenv("LOCAL_RANK", "0")
    code, _, err = run(capsys, *args)
    assert code == 0 and "cutpipe doctor: advice: NCCL channels" in err
    assert len(err.strip().splitlines()) == 3  # allocator, channels, socket threads
    monkeypatch.setenv("LOCAL_RANK", "1")
    code, _, err = run(capsys, *args)
    assert code == 0 and err == ""
