"""Starting processes: ``cutpipe train``'s workers under torch's elastic agent (``elastic``), and
a function on N local ranks for tests, benchmarks and ``cutpipe bench`` (``local``)."""

from cutpipe.launch.local import LaunchError, Outcome, run, spawn

__all__ = ["LaunchError", "Outcome", "run", "spawn"]
