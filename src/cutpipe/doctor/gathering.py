"""The facts the doctor judges, gathered from this process into a ``Machine``.

Everything the checks read comes in here (torch, the environment, /proc/modules,
/sys/class/infiniband, NCCL's configuration files), so the checks stay pure functions of a
``Machine`` and a test can describe a GPU node it does not have. Importing this module does not
import torch; ``gather`` does, when called.
"""

from __future__ import annotations

import math
import os
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

#: Where NCCL reads settings that the environment does not give, highest precedence first:
#: ``NCCL_CONF_FILE`` (or ``~/.nccl.conf`` without it), then the system-wide file.
SYSTEM_NCCL_CONF = "/etc/nccl.conf"
#: The environment variables the checks read, by name or prefix (the rest is not kept).
READ = ("NCCL_", "PYTORCH_", "CUDA_VISIBLE_DEVICES", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


@dataclass(frozen=True)
class Machine:
    """The facts the checks read. ``None`` means "could not be found out here"."""

    node: str = "localhost"
    environ: Mapping[str, str] = field(default_factory=dict)
    torch_version: str | None = None  # None: torch does not import
    cuda_version: str | None = None  # torch.version.cuda; None: a CPU build
    gpus: int = 0  # GPUs this process sees
    no_gpu: str = ""  # why gpus is 0, or why the GPUs were not probed
    gpu_name: str | None = None
    capability: tuple[int, int] | None = None
    nccl_version: tuple[int | str, ...] | None = None  # None: torch has no NCCL (or no GPU)
    bf16: bool | None = None  # native bf16 (not emulated)
    cuda_graphs: bool | None = None  # a capture and replay worked
    cuda_graphs_error: str = ""
    peer_access: bool | None = None  # GPU 0 reaches GPU 1 directly; None: fewer or unprobed
    modules: frozenset[str] | None = None  # loaded kernel modules (/proc/modules)
    infiniband: tuple[str, ...] | None = None  # /sys/class/infiniband entries; () when none
    kernel: str = ""  # os.uname().release
    nccl_files: tuple[tuple[str, Mapping[str, str]], ...] = ()  # (path, settings), first wins
    nodes: int | None = None  # nodes of this run when known (under torchrun), else None

    @property
    def torch_release(self) -> tuple[int, int] | None:
        """(major, minor) of torch, to compare against the releases a check knows about."""
        return _major_minor(self.torch_version)

    @property
    def kernel_release(self) -> tuple[int, int] | None:
        """(major, minor) of the Linux kernel, e.g. (6, 8) for "6.8.0-45-generic"."""
        return _major_minor(self.kernel)


def _major_minor(text: str | None) -> tuple[int, int] | None:
    """The leading "X.Y" of a version string as numbers, None where it does not start so."""
    match = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def read_modules(path: str = "/proc/modules") -> frozenset[str] | None:
    """Names of the loaded kernel modules, or None where the file cannot be read."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    return frozenset(line.split()[0] for line in text.splitlines() if line.strip())


def read_infiniband(path: str = "/sys/class/infiniband") -> tuple[str, ...] | None:
    """RDMA devices (InfiniBand or RoCE) the kernel knows: () when there are none, None where
    this is not Linux."""
    folder = Path(path)
    if not folder.exists():
        return () if Path("/sys/class").is_dir() else None
    try:
        return tuple(sorted(entry.name for entry in folder.iterdir()))
    except OSError:
        return None


def read_nccl_conf(path: str) -> dict[str, str]:
    """``NAME=value`` lines of an NCCL configuration file ({} when there is none)."""
    try:
        text = Path(path).expanduser().read_text()
    except OSError:
        return {}
    settings = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            name, value = line.split("=", 1)
            settings.setdefault(name.strip(), value.strip())
    return settings


def nccl_files(environ: Mapping[str, str]) -> tuple[tuple[str, Mapping[str, str]], ...]:
    """The NCCL configuration files that hold settings, in NCCL's order of precedence."""
    user = environ.get("NCCL_CONF_FILE") or "~/.nccl.conf"
    found = ((path, read_nccl_conf(path)) for path in (user, SYSTEM_NCCL_CONF))
    return tuple((path, settings) for path, settings in found if settings)


def nodes_of(environ: Mapping[str, str]) -> int | None:
    """Nodes of a torchrun job from its variables (WORLD_SIZE / LOCAL_WORLD_SIZE), else None."""
    try:
        world, local = int(environ["WORLD_SIZE"]), int(environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    return math.ceil(world / local) if world > 0 and local > 0 else None


def _cuda_graphs_work(torch) -> tuple[bool, str]:
    """Capture one in-place add in a CUDA graph and replay it: does the replay do the add?"""
    x = torch.zeros(8, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the default stream, as torch's notes do
        x.add_(1)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    value = float(x[0].item())
    return value == 2.0, "" if value == 2.0 else f"the replay left {value:g}, not 2"


def _probe(call: Callable[[], object]) -> tuple[object, str]:
    try:
        return call(), ""
    except Exception as error:  # a probe that fails is a fact, not a crash
        return None, f"{type(error).__name__}: {str(error).strip().splitlines()[0][:160]}"


def gather(environ: Mapping[str, str] | None = None, *, probe: bool = True) -> Machine:
    """The facts of this machine and process. ``probe=False`` leaves out what creates a CUDA
    context (device properties, bf16, a CUDA-graph capture, peer access): a launcher that has
    not started its workers yet should not hold a GPU."""
    source = os.environ if environ is None else environ
    environ = {name: value for name, value in source.items() if name.startswith(READ)}
    facts: dict = {
        "node": socket.gethostname(),
        "environ": environ,
        "modules": read_modules(),
        "infiniband": read_infiniband(),
        "kernel": os.uname().release if hasattr(os, "uname") else "",
        "nccl_files": nccl_files(environ),
        "nodes": nodes_of(environ),
    }
    try:
        import torch
    except Exception as error:  # not installed, or broken
        return Machine(**facts, no_gpu=f"torch does not import ({type(error).__name__}: {error})")
    facts["torch_version"] = torch.__version__
    hip = getattr(torch.version, "hip", None)
    facts["cuda_version"] = torch.version.cuda or (f"ROCm (HIP {hip})" if hip else None)
    if facts["cuda_version"] is None:
        return Machine(**facts, no_gpu=f"this torch ({torch.__version__}) is a CPU build")
    count, error = _probe(torch.cuda.device_count)
    if not count:
        visible = environ.get("CUDA_VISIBLE_DEVICES")
        reason = error or (
            f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU"
            if visible is not None and not visible.strip()
            else "torch finds no GPU (no NVIDIA driver, or no device)"
        )
        return Machine(**facts, no_gpu=reason)
    facts["gpus"] = int(count)
    version, _ = _probe(torch.cuda.nccl.version)
    facts["nccl_version"] = tuple(version) if isinstance(version, tuple) else None
    if not probe:
        return Machine(**facts, no_gpu="not probed: that would open a CUDA context")
    name, _ = _probe(lambda: torch.cuda.get_device_name(0))
    capability, _ = _probe(lambda: tuple(torch.cuda.get_device_capability(0)))
    facts["gpu_name"] = name if isinstance(name, str) else None
    facts["capability"] = capability if isinstance(capability, tuple) else None

    def native_bf16() -> bool:
        try:
            return bool(torch.cuda.is_bf16_supported(including_emulation=False))
        except TypeError:  # a torch without the argument
            return facts["capability"] is not None and facts["capability"] >= (8, 0)

    bf16, _ = _probe(native_bf16)
    facts["bf16"] = bf16 if isinstance(bf16, bool) else None
    result, error = _probe(lambda: _cuda_graphs_work(torch))
    if isinstance(result, tuple):
        facts["cuda_graphs"], facts["cuda_graphs_error"] = result
    else:
        facts["cuda_graphs"], facts["cuda_graphs_error"] = False, error
    if count >= 2:
        peer, _ = _probe(lambda: bool(torch.cuda.can_device_access_peer(0, 1)))
        facts["peer_access"] = peer if isinstance(peer, bool) else None
    return Machine(**facts)
