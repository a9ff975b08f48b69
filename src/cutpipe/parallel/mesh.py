"""Process groups for pipeline x data x expert parallelism, from torch's ``DeviceMesh``.

The world is a ``(pp, dp, ep)`` mesh with EP innermost, so the ranks sharing a stage's experts
are neighbours (on one node, where the all-to-alls are cheapest): rank = ``(p * dp + d) * ep + e``.
Along ``pp`` run the pipelines (one ``PipelineRunner`` per pipeline, ``group=mesh.pp_group``);
along ``ep`` the ranks of one stage split its experts and exchange tokens; along ``dp`` whole
copies train on other data.

Each pipeline trains on its own share of the batch (``replica`` of ``replicas = dp * ep``), so
every parameter outside the experts has ``replicas`` copies and each expert ``dp``:
``reduce_gradients`` averages both over the replicas, giving the gradient of the mean loss over
all shares. ``Layout.check`` says what to change before any process group is created.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from cutpipe.parallel.data_parallel import AllReduce


def check_experts(experts: int, ep: int, top_k: int | None = None) -> None:
    """Raise a ValueError naming what to change if ``ep`` ranks cannot share ``experts``."""
    if ep < 1:
        raise ValueError(f"the expert-parallel size must be >= 1, got {ep}")
    if experts < 1:
        if ep > 1:
            raise ValueError(f"EP {ep} needs an MoE model; this one has no experts: use EP 1")
        return
    if experts % ep:
        divisors = ", ".join(str(d) for d in range(1, experts + 1) if experts % d == 0)
        raise ValueError(
            f"expert-parallel size {ep} does not divide the {experts} experts: use an EP size "
            f"in {divisors}"
        )
    if top_k is not None and top_k > experts:
        raise ValueError(
            f"top_k {top_k} is more than the {experts} experts: use top_k <= {experts}"
        )


@dataclass(frozen=True)
class Layout:
    """How many ways each kind of parallelism splits the world."""

    pp: int
    ep: int = 1
    dp: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.ep * self.dp

    def check(self, world_size: int, experts: int | None = None, top_k: int | None = None) -> None:
        """Raise a ValueError naming what to change; touches no process group."""
        for name in ("pp", "ep", "dp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if experts is not None:
            check_experts(experts, self.ep, top_k)
        if self.world_size != world_size:
            raise ValueError(
                f"a mesh of PP {self.pp} x EP {self.ep} x DP {self.dp} = {self.world_size} ranks "
                f"does not match the world size {world_size}: choose sizes whose product is "
                f"{world_size}, or start {self.world_size} processes"
            )


@dataclass
class ParallelMesh:
    """This rank's groups and coordinates in a ``(pp, dp, ep)`` mesh."""

    layout: Layout
    mesh: object  # torch.distributed.device_mesh.DeviceMesh
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    ep_group: dist.ProcessGroup
    pp_rank: int
    dp_rank: int
    ep_rank: int

    @property
    def replicas(self) -> int:
        """Pipelines training on different shares of the batch."""
        return self.layout.dp * self.layout.ep

    @property
    def replica(self) -> int:
        """Which share of the batch this rank's pipeline trains on."""
        return self.dp_rank * self.layout.ep + self.ep_rank

    def shard(self, batch: torch.Tensor) -> torch.Tensor:
        """This pipeline's share of a global batch (split along dim 0)."""
        if batch.shape[0] % self.replicas:
            raise ValueError(
                f"a batch of {batch.shape[0]} does not split over {self.replicas} replicas "
                f"(DP {self.layout.dp} x EP {self.layout.ep}): use a multiple of {self.replicas}"
            )
        return batch.chunk(self.replicas)[self.replica]

    @torch.no_grad()
    def reduce_gradients(
        self, parameters: Iterable[nn.Parameter], sharded: Iterable[nn.Parameter] = ()
    ) -> None:
        """Average gradients over the replicas now; ``sharded`` (experts) live on one EP rank each.

        Replicated parameters are summed over EP and DP, experts over DP only (their EP
        neighbours hold other experts and already received these experts' gradients through the
        combine's backward); both are divided by ``dp * ep``. ``gradient_reducer`` does the same
        inside the step, stage by stage.
        """
        reducer = self.gradient_reducer(sharded)
        reducer.stage_done(0, list(parameters))
        reducer.finish()

    def gradient_reducer(self, sharded: Iterable[nn.Parameter] = ()) -> AllReduce:
        """A ``PipelineRunner(reducer=...)`` that averages each stage's gradients over the
        replicas as ``reduce_gradients`` does, started as soon as the stage's last backward of
        the step has run (``cutpipe.parallel.data_parallel``)."""
        experts = {id(p) for p in sharded}
        replicated = self.replica_groups
        own = [self.dp_group] if self.layout.dp > 1 else []
        return AllReduce(
            replicated,
            scale=1.0 / self.replicas,
            groups_of=lambda parameter: own if id(parameter) in experts else replicated,
        )

    def replica_mesh(self) -> object:
        """The 1-D DeviceMesh of this pipeline rank's DP x EP replicas, what FSDP shards a
        parameter that every replica holds over (a collective: every rank calls it once)."""
        from torch.distributed.device_mesh import init_device_mesh

        device_type = self.mesh.device_type  # type: ignore[attr-defined]
        shape = (self.layout.pp, self.replicas)
        return init_device_mesh(device_type, shape, mesh_dim_names=("pp", "replica"))["replica"]

    @property
    def replica_groups(self) -> list[dist.ProcessGroup]:
        """The groups a replicated value is summed over, EP's then DP's (those of one rank
        left out)."""
        return [g for g, size in ((self.ep_group, self.layout.ep),
                                  (self.dp_group, self.layout.dp)) if size > 1]  # fmt: skip

    def sum_over_replicas(self, value: torch.Tensor) -> torch.Tensor:
        """The sum of ``value`` over the replicas (e.g. each pipeline's expert loads), new."""
        return self.start_sum_over_replicas(value)()

    def start_sum_over_replicas(self, value: torch.Tensor) -> Callable[[], torch.Tensor]:
        """``sum_over_replicas`` in two halves: the first all-reduce starts now, and the
        returned call (made once) waits for it and runs the second, over DP, when there are both
        EP and DP replicas; what a rank does in between hides the wait."""
        total = value.detach().clone()
        groups = self.replica_groups
        work = dist.all_reduce(total, group=groups[0], async_op=True) if groups else None

        def finish() -> torch.Tensor:
            if work is not None:
                work.wait()
            for group in groups[1:]:
                dist.all_reduce(total, group=group)
            return total

        return finish

    def average(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of ``value`` over the replicas (e.g. each pipeline's loss)."""
        return self.sum_over_replicas(value) / self.replicas

    def start_average(self, value: torch.Tensor) -> Callable[[], torch.Tensor]:
        """``average`` in two halves, as ``start_sum_over_replicas``."""
        summed = self.start_sum_over_replicas(value)
        return lambda: summed() / self.replicas


def build_mesh(
    pp: int,
    ep: int = 1,
    dp: int = 1,
    *,
    experts: int | None = None,
    top_k: int | None = None,
    device_type: str = "cpu",
) -> ParallelMesh:
    """Check the layout, then build the ``(pp, dp, ep)`` DeviceMesh over the default group."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "torch.distributed is not initialized: call init_process_group (torchrun, or "
            "cutpipe.launch.local) before building a mesh"
        )
    layout = Layout(pp, ep, dp)
    layout.check(dist.get_world_size(), experts, top_k)  # before any group is created
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (pp, dp, ep), mesh_dim_names=("pp", "dp", "ep"))
    p, d, e = mesh.get_coordinate()
    return ParallelMesh(
        layout,
        mesh,
        mesh.get_group("pp"),
        mesh.get_group("dp"),
        mesh.get_group("ep"),
        p,
        d,
        e,
    )
