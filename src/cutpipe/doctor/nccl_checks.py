"""The checks of NCCL's settings for the V's doubled pipeline traffic: P2P inside a node, the
channel count, the transport between nodes, GPUDirect RDMA and the socket threads.

A V schedule puts two stages on every rank, so every rank sends twice per microbatch in each
direction where 1F1B sends once (docs/deployment.md). A setting counts where NCCL would read it:
the environment first, then NCCL's configuration files.
"""

from __future__ import annotations

import math

from cutpipe.doctor.findings import ADVICE, OK, UNCHECKED, WARNING, Finding, unchecked_without_gpu
from cutpipe.doctor.gathering import Machine

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
    """A setting as the finding shows it: with the file it came from, or "unset"."""
    if value is None:
        return f"{name} unset"
    return f"{name}={value}" + (f" (in {where})" if where else "")


def _int_or_none(value: str | None) -> int | None:
    """A setting's value as an int; None when unset or not a number (NCCL ignores those)."""
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


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
        return unchecked_without_gpu("NCCL P2P", machine)
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
    cap = _int_or_none(high)
    if cap is not None and cap < floor_wanted:
        return Finding(
            "NCCL channels", _shown("NCCL_MAX_NCHANNELS", high, high_where), ADVICE,
            f"raise NCCL_MAX_NCHANNELS to at least {floor_wanted}", why,
        )  # fmt: skip
    shown = _shown("NCCL_MIN_NCHANNELS", low, where)
    if low is None:
        return Finding("NCCL channels", shown, ADVICE, advise, why)
    floor = _int_or_none(low)
    if floor is None or floor < 1:
        return Finding(
            "NCCL channels", shown, WARNING,
            f"set it to a whole number, e.g. {floor_wanted}",
            "NCCL ignores a value it cannot read.",
        )  # fmt: skip
    if floor < floor_wanted:
        return Finding("NCCL channels", shown, ADVICE, advise, why)
    return Finding("NCCL channels", shown, OK, "", why)


def network_transport(machine: Machine) -> tuple[str, str, str]:
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
    kind, shown, idle = network_transport(machine)
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
    kind, shown, _ = network_transport(machine)
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
    kernel = machine.kernel_release
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
    kind, shown, _ = network_transport(machine)
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
    each = [1 if value is None else _int_or_none(value) for value in (threads, sockets)]
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
