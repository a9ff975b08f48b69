"""Benchmarks shipped with cutpipe: the seed's MoE comparison, measured here and simulated at scale.

``simulated`` (pure Python, no torch) times the schedules at the seed's scale from the model's
FLOPs and bytes; ``measured`` runs them for real on local gloo processes; ``report`` puts both in
one table in the seed's layout, with what agrees with the seed and what does not.
"""

from cutpipe.bench.report import Row

__all__ = ["Row"]
