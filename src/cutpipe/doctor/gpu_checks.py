"""The checks of what this process's torch gives a V schedule on GPUs: the versions of torch,
CUDA and NCCL, the GPUs, bf16, CUDA graphs and the caching allocator's settings.

A V schedule (ZB-V, DualPipeV, Cut-in-half) puts two stages on every rank: its stages are half as
long, so fixed costs per op weigh twice as much, and a rank keeps two stages' activations alive at
once (docs/deployment.md). Each check is a pure function of a ``Machine`` giving one ``Finding``.
"""

from __future__ import annotations

from cutpipe.doctor.findings import ADVICE, OK, UNCHECKED, WARNING, Finding, unchecked_without_gpu
from cutpipe.doctor.gathering import Machine

#: torch from which ``PYTORCH_ALLOC_CONF`` is the allocator variable to set; torch reads the
#: older ``PYTORCH_CUDA_ALLOC_CONF`` too. torch 2.9 already reads the new name but, on CUDA,
#: ignored its ``expandable_segments`` (pytorch/pytorch#183387), so before 2.11 the old one.
ALLOC_CONF_FROM = (2, 11)
NEW_ALLOC, OLD_ALLOC = "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE = "expandable_segments:True"


def check_torch(machine: Machine) -> Finding:
    if machine.torch_version is None:
        return Finding(
            "torch",
            "not importable",
            WARNING,
            "pip install torch (a CUDA build on GPU nodes)",
            f"every run and every GPU check needs it; {machine.no_gpu}.",
        )
    return Finding(
        "torch", machine.torch_version, OK, "", "cutpipe's runtime, CUDA and NCCL come with it."
    )


def check_cuda(machine: Machine) -> Finding:
    if machine.torch_version is not None and machine.cuda_version is None:
        return Finding(
            "CUDA",
            "none (CPU build of torch)",
            UNCHECKED,
            "install a CUDA build of torch on GPU nodes",
            f"it needs a GPU, and {machine.no_gpu}.",
        )
    if machine.cuda_version is None:
        return unchecked_without_gpu("CUDA", machine)
    return Finding("CUDA", machine.cuda_version, OK, "", "the CUDA runtime torch was built with.")


def check_gpus(machine: Machine) -> Finding:
    if machine.gpus == 0:
        return unchecked_without_gpu("GPUs", machine, "none")
    kind = machine.gpu_name or "GPU"
    capability = (
        f", compute capability {machine.capability[0]}.{machine.capability[1]}"
        if machine.capability
        else ""
    )
    return Finding(
        "GPUs",
        f"{machine.gpus} x {kind}{capability}",
        OK,
        "",
        "the devices this process sees; a pipeline rank takes one each.",
    )


def check_nccl(machine: Machine) -> Finding:
    if machine.gpus == 0:
        return unchecked_without_gpu("NCCL", machine)
    if machine.nccl_version is None:
        return Finding(
            "NCCL",
            "not in this torch",
            WARNING,
            "install a torch build with NCCL, or train with --backend gloo (slow)",
            "gloo copies every pipeline send through host memory, and a V sends twice as often.",
        )
    return Finding(
        "NCCL",
        ".".join(str(part) for part in machine.nccl_version),
        OK,
        "",
        "the library that carries the pipeline's sends between GPUs (--backend nccl).",
    )


def check_bf16(machine: Machine) -> Finding:
    if machine.gpus == 0 or machine.bf16 is None:
        return unchecked_without_gpu("bf16", machine)
    if machine.bf16:
        return Finding(
            "bf16",
            "native",
            OK,
            "train with --dtype bf16",
            "bf16 autocast runs the matmuls at the tensor cores' bf16 rate with fp32's exponent "
            "range, so no loss scaling is needed.",
        )
    return Finding(
        "bf16",
        "emulated only (compute capability below 8.0)",
        ADVICE,
        "train with --dtype fp32 (the default) on this GPU",
        "without bf16 tensor cores autocast to bf16 is emulated and slower than fp32.",
    )


def check_cuda_graphs(machine: Machine) -> Finding:
    if machine.gpus == 0 or machine.cuda_graphs is None:
        return unchecked_without_gpu("CUDA graphs", machine)
    why = (
        "a V has twice as many stages, each half as long, so per-op launch overhead weighs twice "
        "as much, which replaying captured graphs removes (a CUDA-graph executor plugs in as an "
        "Executor, docs/architecture.md)."
    )
    if machine.cuda_graphs:
        return Finding("CUDA graphs", "capture and replay work", OK, "", why)
    return Finding(
        "CUDA graphs",
        f"capture failed ({machine.cuda_graphs_error or 'no reason given'})",
        ADVICE,
        "run eagerly here; update the driver or torch before counting on graphs",
        why,
    )


def _alloc_options(conf: str) -> dict[str, str]:
    options = {}
    for part in conf.split(","):
        if ":" in part:
            key, value = part.split(":", 1)
            options[key.strip()] = value.strip()
    return options


def check_allocator(machine: Machine) -> Finding:
    """``expandable_segments:True`` in the allocator variable this torch reads."""
    new, old = machine.environ.get(NEW_ALLOC), machine.environ.get(OLD_ALLOC)
    version = machine.torch_release
    preferred = NEW_ALLOC if version is None or version >= ALLOC_CONF_FROM else OLD_ALLOC
    why = (
        "a V keeps two stages' activations of different sizes alive at once, and expandable "
        "segments grow one mapping instead of leaving freed blocks too small to reuse, the "
        "fragmentation behind out-of-memory errors with memory still free."
    )
    advise = f"export {preferred}={EXPANDABLE} before starting the run"
    if preferred == NEW_ALLOC:
        read, name = (new, NEW_ALLOC) if new is not None else (old, OLD_ALLOC)
    else:
        read, name = old, OLD_ALLOC
        if new is not None and old is None:
            return Finding(
                "allocator",
                f"{NEW_ALLOC}={new}",
                WARNING,
                f"set {OLD_ALLOC}={new} instead",
                f"torch {machine.torch_version} ignores expandable_segments in {NEW_ALLOC} on "
                "CUDA; it reads the older name.",
            )
    if new is not None and old is not None and new != old:
        return Finding(
            "allocator",
            f"{NEW_ALLOC}={new}, {OLD_ALLOC}={old}",
            WARNING,
            f"keep only {preferred}={EXPANDABLE}",
            f"the two differ, and this torch takes expandable_segments from {name} alone.",
        )
    if read is None:
        return Finding("allocator", f"{NEW_ALLOC} and {OLD_ALLOC} unset", ADVICE, advise, why)
    options = _alloc_options(read)
    shown = f"{name}={read}"
    if options.get("backend", "native") != "native":
        return Finding(
            "allocator",
            shown,
            OK,
            "",
            "CUDA's own asynchronous allocator manages its pool; expandable segments are the "
            "native allocator's answer to fragmentation.",
        )
    value = options.get("expandable_segments")
    if value in ("True", "true"):
        return Finding("allocator", shown, OK, "", why)
    if value is not None and value not in ("False", "false"):
        return Finding(
            "allocator",
            shown,
            WARNING,
            f"write expandable_segments:True ({value!r} is not True or False)",
            "torch refuses a value it cannot read when it first allocates on the GPU.",
        )
    return Finding("allocator", shown, ADVICE, f"add {EXPANDABLE} to {name}", why)
