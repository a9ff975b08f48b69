"""Stages balanced on the machine that runs them.

The planner's partition prices blocks on a nominal H100 (``Task.default_sizes``): right for
planning a cluster, wrong wherever the machine at hand differs (a CPU's attention and softmax,
the fixed cost of a small op), and a stage that is slower here than on paper stretches every
step by the bubble it makes. So before it builds anything, the trainer times one block of each
kind (embedding, dense layer, MoE layer, head) as the runtime runs them (``cutpipe.profiling``:
F, then B with the weight gradients deferred, then W), at the run's microbatch and precision and
with the workers' threads, on pipeline rank 0 while the others wait. Every rank reads the same
figures and balances the same stages from them with the planner's search
(``cutpipe.plan.partition.balance``), for any schedule and placement.

The figures are cached by model, microbatch, precision, device and threads
(``$XDG_CACHE_HOME/cutpipe/costs``), so the next run starts without timing anything; ``--profile
FILE`` (from ``cutpipe profile``) gives them instead, and ``--balance nominal`` keeps the
planner's partition.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from cutpipe.plan.costs.profile import Profile
from cutpipe.schedule.schedule import Schedule
from cutpipe.spec import ModelSpec, spec_differences

if TYPE_CHECKING:
    import torch

    from cutpipe.train.options import TrainOptions

#: what a profile is timed over: enough rounds that a median shrugs off one slow round
REPEATS, WARMUP = 5, 2


@dataclass(frozen=True)
class Balance:
    """A partition and what the simulator expects of it with the costs it was balanced on."""

    sizes: tuple[int, ...]
    source: str  # where the costs came from, in words
    rank_seconds: tuple[float, ...]  # each pipeline rank's busy time per pipeline step
    step_seconds: float  # the simulated pipeline step (no runtime overhead)

    def expected(self) -> str:
        """What the simulator expects of the partition with the costs it was balanced on."""
        busy = ", ".join(f"{seconds * 1e3:.1f}" for seconds in self.rank_seconds)
        return f"expected per step: ranks busy {busy} ms, pipeline {self.step_seconds * 1e3:.1f} ms"

    def to_dict(self) -> dict:
        return asdict(self)


def cache_directory() -> Path:
    """Where measured costs are kept between runs."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "cutpipe" / "costs"


def profile_key(spec: ModelSpec, device: torch.device, dtype: str, threads: int) -> str:
    """What a measurement depends on, digested: the model and microbatch, precision, device
    (its name on a GPU), threads and torch's version."""
    import torch

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    record = {
        "model": {k: v for k, v in asdict(spec).items() if k != "name"},
        "dtype": dtype, "device": where, "threads": threads, "torch": torch.__version__,
    }  # fmt: skip
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:24]


def measure(spec: ModelSpec, device: torch.device, dtype: str) -> tuple[Profile, str]:
    """The profile of ``spec`` on ``device``: from the cache, or timed now and cached; and
    where it came from, in words."""
    import torch

    from cutpipe.profiling import profile_model

    path = cache_directory() / f"{profile_key(spec, device, dtype, torch.get_num_threads())}.json"
    if path.exists():
        try:
            return Profile.load(path), f"costs measured on this machine earlier ({path})"
        except ValueError:
            pass  # a damaged cache entry is measured again
    profile = profile_model(spec, str(device), dtype, repeats=REPEATS, warmup=WARMUP)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        profile.save(path)
    except OSError:
        return profile, "costs measured on this machine now (not cached: cannot write the cache)"
    return profile, f"costs measured on this machine now (cached in {path})"


def check_profile(profile: Profile, spec: ModelSpec, path: str) -> None:
    """A profile of another model or microbatch would balance the wrong stages: say which."""
    differ = spec_differences(spec, profile.model, ignore=("name",))
    if differ:
        raise ValueError(
            f"--profile {path} measured another model than the run's (the run's vs the "
            f"profile's): {'; '.join(differ[:4])}; profile the run's model (cutpipe profile "
            "--model FILE, with its microbatch_size and seq_len as the run uses them)"
        )


def balance_stages(schedule: Schedule, profile: Profile, source: str, ep: int = 1) -> Balance:
    """The partition of ``profile``'s model for ``schedule`` with the shortest simulated step,
    from the measured costs (transfers priced by the nominal hardware model, which only breaks
    ties between partitions)."""
    from cutpipe.plan.costs.model import gpu, p2p_time
    from cutpipe.plan.partition import balance
    from cutpipe.sim import metrics, simulate

    hardware = gpu("H100")
    items = profile.items_for(hardware, ep)
    if len(items) < schedule.num_stages:
        raise ValueError(
            f"{profile.model.name} has {len(items)} blocks, too few for the "
            f"{schedule.num_stages} stages of {schedule.name}: use fewer ranks"
        )
    comm = p2p_time(profile.model, hardware, within_node=True)
    best = balance(schedule, items, comm, profile.w_memory)
    expected = metrics(simulate(schedule, best.costs), best.costs)
    return Balance(tuple(best.sizes), source, tuple(expected.busy_per_rank), expected.makespan)


def agreed_balance(
    spec: ModelSpec, schedule: Schedule, options: TrainOptions, device: torch.device,
    first: bool, ep: int = 1,
) -> Balance:  # fmt: skip
    """The partition every rank of the run balances alike: the ``first`` rank (global rank 0)
    reads ``--profile``, the cache, or times the blocks, and broadcasts the figures (or the
    error, so that no rank waits for figures that will not come). A call on every rank."""
    import torch.distributed as dist

    payload: list[object] = [None]
    if first:
        try:
            if options.profile:
                profile = Profile.load(options.profile)
                check_profile(profile, spec, options.profile)
                source = f"--profile {options.profile}"
            else:
                profile, source = measure(spec, device, options.dtype)  # fp32 or bf16
            payload[0] = ("ok", profile.to_dict(), source)
        except (ValueError, OSError) as error:
            payload[0] = ("error", f"{type(error).__name__}: {error}", "")
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(payload, src=0)
    status, content, source = payload[0]
    if status == "error":
        raise ValueError(f"balancing the stages failed on rank 0: {content}")
    return balance_stages(schedule, Profile.from_dict(content, source), source, ep)


def run_spec(spec: ModelSpec, microbatch: int) -> ModelSpec:
    """The model as one microbatch of the run sees it."""
    return replace(spec, microbatch_size=microbatch)
