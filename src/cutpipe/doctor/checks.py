"""What this machine needs for a V schedule on GPUs: the checks behind ``cutpipe doctor``.

A V schedule (ZB-V, DualPipeV, Cut-in-half) puts two stages on every rank, so every rank sends
twice per microbatch in each direction where 1F1B sends once; its stages are half as long, so
fixed costs per op weigh twice as much; and a rank keeps two stages' activations alive at once.
The checks below look at what decides how well a machine takes that (docs/deployment.md): NCCL's
channels and transports, the caching allocator's fragmentation, CUDA graphs and bf16.

Every fact comes in through a ``Machine`` that ``gather`` fills from this process (torch, the
environment, /proc/modules, /sys/class/infiniband, NCCL's configuration files); ``diagnose`` is a
pure function of it, so a test describes a GPU node it does not have. Each ``Finding`` says what
was seen, whether it is fine ("ok"), could be better ("advice"), is likely hurting ("warning") or
could not be looked at here ("unchecked"), what to do and why, in one sentence each.
"""

from __future__ import annotations

import math
import os
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

OK, ADVICE, WARNING, UNCHECKED = "ok", "advice", "warning", "unchecked"
STATUSES = (OK, ADVICE, WARNING, UNCHECKED)

#: The least floor ``NCCL_MIN_NCHANNELS`` should give: a V rank sends to two neighbours, and NCCL
#: uses two channels per peer over PCIe or the network (more over NVLink), so 2 x 2. With GPUs
#: the floor is twice their count, as the Cut-in-half report suggests (``channel_floor``).
MIN_CHANNELS = 4
#: ``NCCL_SOCKET_NTHREADS`` and ``NCCL_NSOCKS_PERTHREAD`` to recommend on socket transports:
#: NCCL's documentation suggests 4 threads on 100 Gb/s networks; the product stays under its 64.
SOCKET_THREADS, SOCKETS_PER_THREAD = 4, 4
#: NCCL's limit on ``NCCL_SOCKET_NTHREADS * NCCL_NSOCKS_PERTHREAD`` (sockets per connection).
MAX_SOCKETS = 64
#: Below this socket count per connection the socket finding advises more.
MIN_SOCKETS = 4
#: Kernel modules that give NCCL GPUDirect RDMA (the second is the older MLNX_OFED name).
PEERMEM_MODULES = ("nvidia_peermem", "nv_peer_mem")
#: Linux from which NCCL can register GPU memory with the NIC through DMA-BUF instead.
DMABUF_KERNEL = (5, 12)
#: torch from which ``PYTORCH_ALLOC_CONF`` is the allocator variable to set; torch reads the
#: older ``PYTORCH_CUDA_ALLOC_CONF`` too. torch 2.9 already reads the new name but, on CUDA,
#: ignored its ``expandable_segments`` (pytorch/pytorch#183387), so before 2.11 the old one.
ALLOC_CONF_FROM = (2, 11)
NEW_ALLOC, OLD_ALLOC = "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE = "expandable_segments:True"
#: Where NCCL reads settings that the environment does not give, highest precedence first:
#: ``NCCL_CONF_FILE`` (or ``~/.nccl.conf`` without it), then the system-wide file.
SYSTEM_NCCL_CONF = "/etc/nccl.conf"
#: The environment variables the checks read, by name or prefix (the rest is not kept).
READ = ("NCCL_", "PYTORCH_", "CUDA_VISIBLE_DEVICES", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


@dataclass(frozen=True)
class Finding:
    """One check: what was seen, how it stands, what to do about it and why."""

    name: str
    value: str
    status: str  # one of STATUSES
    advice: str  # what to do ("" when nothing is)
    why: str  # one sentence

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}, not {self.status!r}")

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


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
        return _version(self.torch_version)


# --- gathering the facts -------------------------------------------------------------------


def _version(text: str | None) -> tuple[int, int] | None:
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


# --- the checks ----------------------------------------------------------------------------


def setting(machine: Machine, name: str) -> tuple[str | None, str]:
    """(value, where) of an NCCL or torch setting: the environment first, then NCCL's files."""
    if name in machine.environ:
        return machine.environ[name], ""
    if name.startswith("NCCL_"):
        for path, settings in machine.nccl_files:
            if name in settings:
                return settings[name], path
    return None, ""


def _shown(name: str, value: str | None, where: str) -> str:
    if value is None:
        return f"{name} unset"
    return f"{name}={value}" + (f" (in {where})" if where else "")


def _whole(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _no_gpu(name: str, machine: Machine, value: str = "not checked") -> Finding:
    return Finding(
        name, value, UNCHECKED, "run cutpipe doctor on a GPU node",
        f"it needs a GPU, and {machine.no_gpu}.",
    )  # fmt: skip


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
        return _no_gpu("CUDA", machine)
    return Finding("CUDA", machine.cuda_version, OK, "", "the CUDA runtime torch was built with.")


def check_gpus(machine: Machine) -> Finding:
    if machine.gpus == 0:
        return _no_gpu("GPUs", machine, "none")
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
        return _no_gpu("NCCL", machine)
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
        return _no_gpu("bf16", machine)
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
        return _no_gpu("CUDA graphs", machine)
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


def check_p2p(machine: Machine) -> Finding:
    disable, where = setting(machine, "NCCL_P2P_DISABLE")
    level, level_where = setting(machine, "NCCL_P2P_LEVEL")
    why = (
        "without it sends between GPUs of a node go through host memory, and every V rank makes "
        "twice as many of them as a 1F1B rank."
    )
    if disable is not None and disable.strip() not in ("", "0"):
        return Finding(
            "NCCL P2P", _shown("NCCL_P2P_DISABLE", disable, where), WARNING,
            "unset NCCL_P2P_DISABLE", why,
        )  # fmt: skip
    if level is not None and level.strip().upper() in ("LOC", "0"):
        return Finding(
            "NCCL P2P", _shown("NCCL_P2P_LEVEL", level, level_where), WARNING,
            "unset NCCL_P2P_LEVEL (NCCL picks the level from the topology)", why,
        )  # fmt: skip
    if machine.gpus == 0:
        return _no_gpu("NCCL P2P", machine)
    if machine.gpus == 1:
        return Finding(
            "NCCL P2P",
            "enabled (one GPU: no sends inside this node)",
            OK,
            "",
            "with one GPU per node every pipeline send crosses the network.",
        )
    if machine.peer_access is False:
        return Finding(
            "NCCL P2P",
            "enabled, but GPUs 0 and 1 cannot reach each other directly",
            ADVICE,
            "put consecutive pipeline ranks on GPUs that share NVLink or a PCIe switch "
            "(nvidia-smi topo -m)",
            why,
        )
    peers = ", GPUs 0 and 1 reach each other" if machine.peer_access else ""
    return Finding("NCCL P2P", f"enabled{peers}", OK, "", why)


def channel_floor(machine: Machine) -> int:
    """The ``NCCL_MIN_NCHANNELS`` to advise: twice the GPUs of the node (the Cut-in-half report's
    suggestion for the doubled pipeline traffic), at least ``MIN_CHANNELS``."""
    return max(MIN_CHANNELS, 2 * machine.gpus)


def check_channels(machine: Machine) -> Finding:
    floor_wanted = channel_floor(machine)
    low, where = setting(machine, "NCCL_MIN_NCHANNELS")
    high, high_where = setting(machine, "NCCL_MAX_NCHANNELS")
    why = (
        "NCCL spreads point-to-point sends over at most the communicator's channels, and a V "
        "rank's sends to both neighbours, twice 1F1B's, queue behind each other on too few."
    )
    advise = f"export NCCL_MIN_NCHANNELS={floor_wanted}"
    cap = _whole(high)
    if cap is not None and cap < floor_wanted:
        return Finding(
            "NCCL channels", _shown("NCCL_MAX_NCHANNELS", high, high_where), ADVICE,
            f"raise NCCL_MAX_NCHANNELS to at least {floor_wanted}", why,
        )  # fmt: skip
    shown = _shown("NCCL_MIN_NCHANNELS", low, where)
    if low is None:
        return Finding("NCCL channels", shown, ADVICE, advise, why)
    floor = _whole(low)
    if floor is None or floor < 1:
        return Finding(
            "NCCL channels", shown, WARNING,
            f"set it to a whole number, e.g. {floor_wanted}",
            "NCCL ignores a value it cannot read.",
        )  # fmt: skip
    if floor < floor_wanted:
        return Finding("NCCL channels", shown, ADVICE, advise, why)
    return Finding("NCCL channels", shown, OK, "", why)


def transport(machine: Machine) -> tuple[str, str, str]:
    """(``"one node"``, ``"ib"``, ``"socket"`` or ``"unknown"``; how it was decided; a warning
    when InfiniBand is there but turned off)."""
    if machine.nodes == 1:
        return "one node", "one node (torchrun's WORLD_SIZE and LOCAL_WORLD_SIZE)", ""
    net, net_where = setting(machine, "NCCL_NET")
    disabled, where = setting(machine, "NCCL_IB_DISABLE")
    devices = machine.infiniband
    forced = ""
    if net is not None and net.strip().lower() == "socket":
        forced = _shown("NCCL_NET", net, net_where)
    elif disabled is not None and disabled.strip() not in ("", "0"):
        forced = _shown("NCCL_IB_DISABLE", disabled, where)
    if forced:
        idle = f"{forced} while {', '.join(devices)} are idle" if devices else ""
        return "socket", f"sockets ({forced})", idle
    if devices is None:
        return "unknown", "cannot read /sys/class/infiniband here", ""
    if devices:
        return "ib", f"InfiniBand/RoCE ({', '.join(devices)})", ""
    return "socket", "sockets (no device in /sys/class/infiniband)", ""


def check_transport(machine: Machine) -> Finding:
    kind, shown, idle = transport(machine)
    if idle:
        return Finding(
            "network transport",
            idle,
            WARNING,
            "unset NCCL_IB_DISABLE / NCCL_NET so NCCL uses the RDMA devices",
            "across nodes the V's doubled sends then go over TCP instead of RDMA.",
        )
    if kind == "unknown":
        return Finding(
            "network transport",
            shown,
            UNCHECKED,
            "run cutpipe doctor on the Linux nodes of the run",
            "which NICs NCCL can use is read from /sys/class/infiniband.",
        )
    why = {
        "one node": "no pipeline send crosses the network: GPUs of one node talk over NVLink "
        "or PCIe.",
        "ib": "RDMA carries the sends between nodes without the CPU copying them.",
        "socket": "TCP sockets carry the sends between nodes; the socket threads line tunes them.",
    }[kind]
    return Finding("network transport", shown, OK, "", why)


def check_gdr(machine: Machine) -> Finding:
    kind, shown, _ = transport(machine)
    why = (
        "GPUDirect RDMA lets the NIC read and write GPU memory, so a send between nodes is not "
        "staged through host memory, which the V's doubled traffic would pay twice."
    )
    if kind != "ib":
        if kind == "unknown":
            return Finding("GPUDirect RDMA", "not checked", UNCHECKED, "", shown + ".")
        return Finding("GPUDirect RDMA", f"not used: {shown}", OK, "", why)
    level, where = setting(machine, "NCCL_NET_GDR_LEVEL")
    if level is not None and level.strip().upper() in ("LOC", "0"):
        return Finding(
            "GPUDirect RDMA", _shown("NCCL_NET_GDR_LEVEL", level, where), WARNING,
            "unset NCCL_NET_GDR_LEVEL (NCCL picks it from the topology)", why,
        )  # fmt: skip
    if machine.modules is None:
        return Finding(
            "GPUDirect RDMA",
            "not checked",
            UNCHECKED,
            "run cutpipe doctor where /proc/modules can be read",
            "whether nvidia-peermem is loaded is read from /proc/modules.",
        )
    loaded = [name for name in PEERMEM_MODULES if name in machine.modules]
    if loaded:
        return Finding("GPUDirect RDMA", f"{loaded[0]} loaded", OK, "", why)
    kernel = _version(machine.kernel)
    if kernel is not None and kernel >= DMABUF_KERNEL:
        return Finding(
            "GPUDirect RDMA",
            f"no nvidia-peermem module (kernel {machine.kernel} allows DMA-BUF)",
            ADVICE,
            "modprobe nvidia-peermem, or check that NCCL_DEBUG=INFO's NET/IB lines say GPU "
            "Direct RDMA is enabled (through DMA-BUF)",
            why,
        )
    return Finding(
        "GPUDirect RDMA",
        f"no nvidia-peermem module (kernel {machine.kernel or 'unknown'})",
        WARNING,
        "modprobe nvidia-peermem (it ships with the NVIDIA driver)",
        why,
    )


def check_sockets(machine: Machine) -> Finding:
    kind, shown, _ = transport(machine)
    why = (
        "NCCL's default of one thread with one socket per connection rarely fills a fast link, "
        "and a V sends twice the pipeline bytes through it."
    )
    name = "NCCL socket threads"
    if kind != "socket":
        if kind == "unknown":
            return Finding(name, "not checked", UNCHECKED, "", shown + ".")
        return Finding(name, f"not used: {shown}", OK, "", why)
    threads, threads_where = setting(machine, "NCCL_SOCKET_NTHREADS")
    sockets, sockets_where = setting(machine, "NCCL_NSOCKS_PERTHREAD")
    shown = (
        f"{_shown('NCCL_SOCKET_NTHREADS', threads, threads_where)}, "
        f"{_shown('NCCL_NSOCKS_PERTHREAD', sockets, sockets_where)}"
    )
    advise = (
        f"export NCCL_SOCKET_NTHREADS={SOCKET_THREADS} NCCL_NSOCKS_PERTHREAD={SOCKETS_PER_THREAD}"
    )
    each = [1 if value is None else _whole(value) for value in (threads, sockets)]
    if any(count is None or count < 1 for count in each):
        return Finding(
            name, shown, WARNING, f"set whole numbers, e.g. {advise}",
            "NCCL ignores a value it cannot read.",
        )  # fmt: skip
    product = math.prod(each)
    if product > MAX_SOCKETS:
        return Finding(
            name, shown, WARNING,
            f"lower them so that their product is at most {MAX_SOCKETS}, e.g. {advise}",
            f"NCCL allows at most {MAX_SOCKETS} sockets per connection.",
        )  # fmt: skip
    if product < MIN_SOCKETS:
        return Finding(name, shown, ADVICE, advise, why)
    return Finding(name, shown, OK, "", why)


#: Every check, in the order the doctor prints them.
CHECKS: tuple[Callable[[Machine], Finding], ...] = (
    check_torch,
    check_cuda,
    check_gpus,
    check_nccl,
    check_bf16,
    check_cuda_graphs,
    check_allocator,
    check_p2p,
    check_channels,
    check_transport,
    check_gdr,
    check_sockets,
)


def diagnose(machine: Machine | None = None) -> list[Finding]:
    """Every check on ``machine`` (default: this one, gathered now)."""
    machine = gather() if machine is None else machine
    return [check(machine) for check in CHECKS]


def warnings(findings: list[Finding]) -> list[str]:
    """One line per finding that asks for something (advice or warning), for a start-up print."""
    return [
        f"{finding.status}: {finding.name} ({finding.value}): {finding.advice}"
        for finding in findings
        if finding.status in (WARNING, ADVICE) and finding.advice
    ]


def startup_warnings(
    environ: Mapping[str, str] | None = None, nodes: int | None = None
) -> list[str]:
    """What ``cutpipe train`` should say before a GPU run, one line each, "cutpipe doctor: ..."
    (empty where torch sees no GPU). Opens no CUDA context, so a launcher can call it before
    starting its workers; ``nodes`` is the run's node count when the caller knows it."""
    machine = gather(environ, probe=False)
    if machine.gpus == 0:
        return []
    if nodes is not None:
        machine = replace(machine, nodes=nodes)
    return [f"cutpipe doctor: {line}" for line in warnings(diagnose(machine))]
