"""Accelerators and their links: presets with sourced figures, and custom ones from a file.

A ``Hardware`` is what the cost model needs of one GPU and the network around it: dense peak
FLOP/s (bf16, and FP8 where the tensor cores have it), memory size and bandwidth, the per-GPU
bandwidth of one direction of the node's fabric (NVLink, Infinity Fabric) and of the network
(one NIC per GPU), and how a transfer and a matrix multiply really behave:

- a transfer of ``n`` bytes takes ``latency + n / bandwidth``; a pipeline send also pays
  ``p2p_overhead`` (launching and matching the send and the receive);
- a matrix multiply reaches ``gemm_efficiency * x / (x + gemm_half_dim)`` of peak, ``x`` its
  smallest dimension: large multiplies saturate, thin ones (a small microbatch, a narrow head)
  do not;
- a ring collective inside a node (tensor parallelism's) reaches ``collective_bandwidth_share``
  of the fabric, NCCL's measured bus bandwidth (not fitted).

The matmul and send figures are fitted to the zero-bubble paper's profiled A100 pass times (see
docs/plan.md, "Calibration") and assumed for the other GPUs, whose libraries reach similar
fractions of their own peaks. Every preset's other figures are the vendor's datasheet values;
``docs/plan.md`` lists them with their sources.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from pathlib import Path

from cutpipe.spec import read_mapping

#: Fitted to the zero-bubble paper's profiled W passes on A100 (docs/plan.md, "Calibration").
GEMM_EFFICIENCY = 0.837
GEMM_HALF_DIM = 92.0
#: Fitted to the same paper's profiled pipeline transfers inside a node: Megatron's batched
#: send/receive costs about a quarter of a millisecond beyond the bytes, and one send pair
#: reaches about a quarter of NVLink's bandwidth. Across nodes a send reaches the NIC's rate.
P2P_OVERHEAD = 230e-6
P2P_BANDWIDTH_SHARE = 0.243  # of the node fabric's bandwidth one pipeline send reaches
#: Not fitted: NCCL's all-reduce on a DGX A100 is commonly measured at about 230 GB/s of bus
#: bandwidth over NVLink's 300 GB/s per direction (nccl-tests), so the ring collectives inside
#: a node (tensor parallelism's) move their bytes at that share of the fabric.
COLLECTIVE_BANDWIDTH_SHARE = 0.767


@dataclass(frozen=True)
class Hardware:
    """One accelerator and the links between them. Bandwidths are per GPU and direction."""

    name: str
    bf16_flops: float  # dense bf16 tensor-core FLOP/s
    memory_bandwidth: float  # bytes/s
    memory: float  # bytes
    intra_bandwidth: float  # bytes/s within a node (NVLink, Infinity Fabric)
    inter_bandwidth: float  # bytes/s between nodes (the network, one NIC per GPU)
    fp8_flops: float = 0.0  # dense FP8 FLOP/s; 0 where the tensor cores have no FP8
    intra_latency: float = 5e-6  # s
    inter_latency: float = 10e-6  # s
    gpus_per_node: int = 8
    gemm_efficiency: float = GEMM_EFFICIENCY
    gemm_half_dim: float = GEMM_HALF_DIM
    p2p_overhead: float = P2P_OVERHEAD
    p2p_bandwidth_share: float = P2P_BANDWIDTH_SHARE
    collective_bandwidth_share: float = COLLECTIVE_BANDWIDTH_SHARE

    def __post_init__(self) -> None:
        problems = []
        for spec in fields(self):
            value = getattr(self, spec.name)
            if spec.name == "name":
                if not isinstance(value, str) or not value:
                    problems.append("name must be a non-empty string")
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                problems.append(f"{spec.name} must be a number, got {value!r}")
            elif not math.isfinite(value) or value < 0:
                problems.append(f"{spec.name} must be a finite number >= 0, got {value}")
        if not problems:
            for name in ("bf16_flops", "memory_bandwidth", "memory", "intra_bandwidth",
                         "inter_bandwidth", "gemm_efficiency", "p2p_bandwidth_share",
                         "collective_bandwidth_share"):  # fmt: skip
                if getattr(self, name) <= 0:
                    problems.append(f"{name} must be > 0")
            shares = ("gemm_efficiency", "p2p_bandwidth_share", "collective_bandwidth_share")
            if any(getattr(self, name) > 1 for name in shares):
                problems.append(f"{', '.join(shares)} are fractions, <= 1")
            if self.gpus_per_node < 1 or self.gpus_per_node != int(self.gpus_per_node):
                problems.append(
                    f"gpus_per_node must be a whole number >= 1, got {self.gpus_per_node}"
                )
        if problems:
            raise ValueError(f"GPU {self.name!r}: " + "; ".join(problems))

    def peak(self, fp8: bool = False) -> float:
        """Dense peak FLOP/s of the matmuls: FP8 where asked and available, else bf16."""
        return self.fp8_flops if fp8 and self.fp8_flops else self.bf16_flops

    def gemm_throughput(self, smallest_dim: float, fp8: bool = False) -> float:
        """FLOP/s a matrix multiply whose smallest dimension is ``smallest_dim`` reaches."""
        x = max(1.0, smallest_dim)
        return self.peak(fp8) * self.gemm_efficiency * x / (x + self.gemm_half_dim)

    def link(self, within_node: bool) -> tuple[float, float]:
        """(bandwidth, latency) of a transfer inside a node or across nodes."""
        if within_node:
            return self.intra_bandwidth, self.intra_latency
        return self.inter_bandwidth, self.inter_latency

    def collective_link(self, within_node: bool) -> tuple[float, float]:
        """(bandwidth, latency) a ring collective reaches: inside a node, its share of the
        fabric (``collective_bandwidth_share``); across nodes, the network's."""
        bandwidth, latency = self.link(within_node)
        if within_node:
            bandwidth *= self.collective_bandwidth_share
        return bandwidth, latency

    def p2p_time(self, size: float, within_node: bool) -> float:
        """Seconds for one pipeline send of ``size`` bytes."""
        bandwidth, latency = self.link(within_node)
        if within_node:
            bandwidth *= self.p2p_bandwidth_share
        return self.p2p_overhead + latency + size / bandwidth


T, G = 1e12, 1e9
#: Vendor datasheet figures (docs/plan.md gives the sources): dense tensor-core peaks (the
#: "with sparsity" figures halved), HBM size and bandwidth, the node fabric per GPU and
#: direction (half the quoted bidirectional figure), one NIC per GPU (HDR InfiniBand
#: 200 Gb/s = 25 GB/s, NDR 400 Gb/s = 50 GB/s).
GPUS = {
    "A100-40GB": Hardware("A100-40GB", 312 * T, 1.555 * T, 40 * G, 300 * G, 25 * G),
    "A100-80GB": Hardware("A100-80GB", 312 * T, 2.039 * T, 80 * G, 300 * G, 25 * G),
    "H100": Hardware("H100", 989 * T, 3.35 * T, 80 * G, 450 * G, 50 * G, fp8_flops=1979 * T),
    "H800": Hardware("H800", 989 * T, 3.35 * T, 80 * G, 200 * G, 50 * G, fp8_flops=1979 * T),
    "H200": Hardware("H200", 989 * T, 4.8 * T, 141 * G, 450 * G, 50 * G, fp8_flops=1979 * T),
    "B200": Hardware("B200", 2250 * T, 8.0 * T, 180 * G, 900 * G, 50 * G, fp8_flops=4500 * T),
    "MI300X": Hardware("MI300X", 1307 * T, 5.3 * T, 192 * G, 448 * G, 50 * G, fp8_flops=2615 * T),
}
ALIASES = {"A100": "A100-80GB"}

#: What a GPU file may hold, in the units a person writes (TFLOP/s, GB, GB/s, microseconds).
FILE_UNITS = {
    "bf16_tflops": ("bf16_flops", T),
    "fp8_tflops": ("fp8_flops", T),
    "memory_gb": ("memory", G),
    "memory_bandwidth_gbps": ("memory_bandwidth", G),
    "intra_node_gbps": ("intra_bandwidth", G),
    "inter_node_gbps": ("inter_bandwidth", G),
    "intra_node_latency_us": ("intra_latency", 1e-6),
    "inter_node_latency_us": ("inter_latency", 1e-6),
    "gpus_per_node": ("gpus_per_node", 1),
    "gemm_efficiency": ("gemm_efficiency", 1),
    "gemm_half_dim": ("gemm_half_dim", 1),
    "p2p_overhead_us": ("p2p_overhead", 1e-6),
    "p2p_bandwidth_share": ("p2p_bandwidth_share", 1),
    "collective_bandwidth_share": ("collective_bandwidth_share", 1),
}
REQUIRED = (
    "bf16_tflops",
    "memory_gb",
    "memory_bandwidth_gbps",
    "intra_node_gbps",
    "inter_node_gbps",
)


def gpu(name: str) -> Hardware:
    """A preset by name (case does not matter), or a GPU file (``.yaml``/``.yml``/``.json``)."""
    if str(name).lower().endswith((".yaml", ".yml", ".json")):
        return load_gpu(name)
    key = ALIASES.get(str(name).upper(), str(name).upper())
    if key not in GPUS:
        raise ValueError(
            f"unknown GPU {name!r}; known: {', '.join(GPUS)} (A100 = A100-80GB), or a "
            "FILE.yaml describing one (docs/plan.md)"
        )
    return GPUS[key]


def load_gpu(path: str | Path) -> Hardware:
    """A custom GPU from YAML or JSON: ``name`` and the keys of ``FILE_UNITS``; a key it lacks
    takes the ``base`` preset's value (``base: H100``), and without a base the five in
    ``REQUIRED`` must be given."""
    data = read_mapping(path, "GPU")
    unknown = sorted(set(data) - set(FILE_UNITS) - {"name", "base"})
    if unknown:
        raise ValueError(
            f"{path}: unknown keys {unknown}; known: name, base, {', '.join(FILE_UNITS)}"
        )
    base = data.get("base")
    if base is None:
        missing = [key for key in REQUIRED if key not in data]
        if missing:
            raise ValueError(
                f"{path}: missing {missing} (or name a preset to start from: base: H100)"
            )
    changes = {"name": str(data.get("name", Path(path).stem))}
    for key, (field, unit) in FILE_UNITS.items():
        if key in data:
            value = data[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{path}: {key} must be a number, got {value!r}")
            changes[field] = value * unit
    if base is not None:
        return replace(gpu(str(base)), **changes)
    return Hardware(**changes)
