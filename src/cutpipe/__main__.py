"""``python -m cutpipe``: the command line, also what ``torchrun ... -m cutpipe train`` runs."""

import os
import sys


def _as_a_worker() -> None:
    """A worker of an elastic agent dies with it, from here on, before torch is imported; under
    cutpipe train the launcher says who it is, so a worker started just before it died ends too
    (cutpipe.launch.orphans). Ctrl-C reaches the workers through the agent, which says so: a
    worker interrupted while still importing ends without a traceback of its own."""
    from cutpipe.launch.orphans import die_with_parent

    launcher = os.environ.get("CUTPIPE_LAUNCHER", "")
    die_with_parent(int(launcher) if launcher.isdigit() else None)
    excepthook = sys.excepthook

    def quiet_interrupt(kind, value, traceback):  # type: ignore[no-untyped-def]
        if not issubclass(kind, KeyboardInterrupt):
            excepthook(kind, value, traceback)

    sys.excepthook = quiet_interrupt


if __name__ == "__main__" and "TORCHELASTIC_RUN_ID" in os.environ:
    _as_a_worker()

from cutpipe.cli.main import main  # noqa: E402 - after the worker's parent-death signal

if __name__ == "__main__":
    sys.exit(main())
