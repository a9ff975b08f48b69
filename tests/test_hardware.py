"""GPU presets and custom GPU files (cutpipe.plan.costs.hardware)."""

from __future__ import annotations

import pytest

from cutpipe.plan.costs.hardware import GPUS, gpu, load_gpu


def test_every_preset_is_there_and_a100_means_the_80_gb_part():
    assert set(GPUS) == {"A100-40GB", "A100-80GB", "H100", "H800", "H200", "B200", "MI300X"}
    assert gpu("a100") is GPUS["A100-80GB"] and gpu("h800").name == "H800"
    assert gpu("H800").intra_bandwidth < gpu("H100").intra_bandwidth  # NVLink cut to 400 GB/s
    assert gpu("H800").bf16_flops == gpu("H100").bf16_flops
    assert not gpu("A100").fp8_flops and gpu("B200").fp8_flops == 2 * gpu("B200").bf16_flops


def test_fp8_peak_only_where_there_is_one():
    assert gpu("H100").peak(fp8=True) == 1979e12 and gpu("H100").peak() == 989e12
    assert gpu("A100").peak(fp8=True) == gpu("A100").peak()


def test_a_gpu_file_from_figures_or_from_a_preset(tmp_path):
    path = tmp_path / "mygpu.yaml"
    path.write_text("bf16_tflops: 500\nmemory_gb: 96\nmemory_bandwidth_gbps: 4000\n"
                    "intra_node_gbps: 400\ninter_node_gbps: 50\ngpus_per_node: 4\n")  # fmt: skip
    custom = gpu(str(path))
    assert custom.name == "mygpu" and custom.bf16_flops == 500e12 and custom.memory == 96e9
    assert custom.gpus_per_node == 4 and custom.fp8_flops == 0
    based = tmp_path / "slow-h100.json"
    based.write_text('{"name": "slow", "base": "H100", "inter_node_gbps": 12.5}')
    slow = load_gpu(based)
    assert slow.inter_bandwidth == 12.5e9 and slow.bf16_flops == gpu("H100").bf16_flops


@pytest.mark.parametrize("text, message", [
    ("bf16_tflops: 500\n", "missing"),
    ("base: H100\nflops: 3\n", "unknown keys"),
    ("base: H100\nmemory_gb: fast\n", "must be a number"),
    ("base: H100\nmemory_gb: -1\n", "finite number >= 0"),
    ("base: H100\ngemm_efficiency: 2\n", "fractions"),
    ("base: V100\n", "unknown GPU"),
    ("- a list\n", "mapping"),
    ("a: [\n", "does not parse"),
])  # fmt: skip
def test_bad_gpu_files_say_what_is_wrong(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        gpu(str(path))
    with pytest.raises(ValueError, match="cannot read GPU file"):
        gpu(str(tmp_path / "missing.yaml"))
