"""Starting processes: ``cutpipe train``'s workers under torch's elastic agent (``elastic``), and
a function on N local ranks for tests, benchmarks and ``cutpipe bench`` (``local``).

The names below load ``local`` (and torch) on first use, so that a worker can import
``cutpipe.launch.orphans`` as its very first step, before torch.
"""

from typing import Any

__all__ = ["LaunchError", "Outcome", "run", "spawn"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from cutpipe.launch import local

        return getattr(local, name)
    raise AttributeError(f"module 'cutpipe.launch' has no attribute {name!r}")
