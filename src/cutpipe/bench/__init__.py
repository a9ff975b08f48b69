"""Benchmarks shipped with cutpipe: the Cut-in-half report's MoE comparison (docs/formulas.md),
measured here and simulated at scale.

``simulated`` (pure Python, no torch) times the schedules at the report's scale from the model's
FLOPs and bytes; ``measured`` runs them for real on local gloo processes; ``report`` puts both in
one table in the report's layout, with which of its claims agree and why, or why not.
"""

from cutpipe.bench.report import Row

__all__ = ["Row"]
