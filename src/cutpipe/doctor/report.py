"""What ``cutpipe doctor`` says: every check on a machine, in order, and the lines to print
before a run for the findings that ask for something.

The machine is gathered through the ``gathering`` module (not a name imported from it), so a
test that puts a described machine in place of ``gathering.gather`` changes what is reported.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

from cutpipe.doctor import gathering
from cutpipe.doctor.findings import ADVICE, WARNING, Finding
from cutpipe.doctor.gathering import Machine
from cutpipe.doctor.gpu_checks import (
    check_allocator,
    check_bf16,
    check_cuda,
    check_cuda_graphs,
    check_gpus,
    check_nccl,
    check_torch,
)
from cutpipe.doctor.nccl_checks import (
    check_channels,
    check_gdr,
    check_p2p,
    check_sockets,
    check_transport,
)

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
    machine = gathering.gather() if machine is None else machine
    return [check(machine) for check in CHECKS]


def warning_lines(findings: list[Finding]) -> list[str]:
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
    machine = gathering.gather(environ, probe=False)
    if machine.gpus == 0:
        return []
    if nodes is not None:
        machine = replace(machine, nodes=nodes)
    return [f"cutpipe doctor: {line}" for line in warning_lines(diagnose(machine))]
