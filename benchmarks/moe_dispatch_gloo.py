"""One MoE layer's forward dispatch on real gloo: a count exchange first, or counts carried along.

Two processes (EP 2) route the same kind of microbatch and dispatch it both ways, taking turns
sample after sample: the uneven dispatch after the all-to-all of per-expert counts (what a layer
does without a capacity), and the counted dispatch (``exchange.CountedAllToAll``: one exchange
of equal blocks, padded to the capacity, that carries the counts). Each sample is ``--repeat``
dispatches in a row, planning and sorting included; the medians are per dispatch. Both send
the same rows: the choices a capacity of ``--capacity-factor`` keeps (the default, experts /
top_k, is every token per expert: nothing is dropped, and a block is twice the rows sent).

    python benchmarks/moe_dispatch_gloo.py [--samples 40] [--repeat 50] [--tokens 128]
        [--hidden 32] [--capacity-factor 2.0]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cutpipe.launch import run
from cutpipe.models.router import capacity, over_capacity
from cutpipe.parallel.expert_parallel import ExpertParallel
from cutpipe.parallel.mesh import build_mesh

EXPERTS, TOP_K = 4, 2


def dispatch_once(parallel: ExpertParallel, tokens: torch.Tensor, chosen, capacity) -> None:
    route = parallel.plan(chosen, capacity)
    if capacity is None:
        parallel.exchange_counts(route)
    parallel.dispatch(route).start(parallel.dispatch_rows(tokens, route)).wait()


def dispatch_times(
    rank: int, world: int, samples: int, repeat: int, tokens: int, hidden: int, factor: float
) -> dict:
    mesh = build_mesh(1, world, experts=EXPERTS, top_k=TOP_K)
    parallel = ExpertParallel(mesh.ep_group, EXPERTS)
    generator = torch.Generator().manual_seed(rank)
    rows = torch.randn(tokens, hidden, generator=generator)
    scores = torch.rand(tokens, EXPERTS, generator=generator)
    best, chosen = scores.topk(TOP_K, dim=-1)
    limit = capacity(factor, tokens, TOP_K, EXPERTS)
    chosen = chosen.masked_fill(over_capacity(chosen, best, limit), EXPERTS)
    ways = {"count exchange first": None, "counted dispatch": limit}
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    for sample in range(samples + 1):
        order = list(ways) if sample % 2 else list(ways)[::-1]
        for way in order:
            torch.distributed.barrier()
            began = time.perf_counter()
            for _ in range(repeat):
                dispatch_once(parallel, rows, chosen, ways[way])
            if sample:  # the first sample warms up
                seconds[way].append((time.perf_counter() - began) / repeat)
    return {way: statistics.median(values) for way, values in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--capacity-factor", type=float, default=EXPERTS / TOP_K)
    args = parser.parse_args()
    arguments = (args.samples, args.repeat, args.tokens, args.hidden, args.capacity_factor)
    result = run(dispatch_times, 2, arguments, timeout=600)[0]
    old, new = result["count exchange first"], result["counted dispatch"]
    print(
        f"EP 2, gloo, {args.tokens} tokens x {args.hidden}, {EXPERTS} experts, top {TOP_K}, "
        f"capacity factor {args.capacity_factor}, "
        f"{args.samples} samples of {args.repeat}: median dispatch with a count exchange first "
        f"{old * 1e3:.3f} ms, counted {new * 1e3:.3f} ms (ratio {new / old:.3f})"
    )


if __name__ == "__main__":
    main()
