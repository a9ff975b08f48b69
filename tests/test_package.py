"""Package-level promises: importing cutpipe and its schedule/sim layers never imports torch."""

import ast
import subprocess
import sys
from pathlib import Path

import cutpipe


def test_import_does_not_pull_in_torch():
    code = (
        "import sys, cutpipe, cutpipe.schedule, cutpipe.sim, cutpipe.formulas, cutpipe.cli.main\n"
        "import cutpipe.viz.png, cutpipe.viz.html, cutpipe.viz.chrome_trace\n"
        "from cutpipe.schedule.cut_in_half import cut_in_half\n"
        "from cutpipe.interop import torch_pipelining\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


LAYERS = {  # package -> what it must not import (DESIGN: imports point downward only)
    "schedule": ("torch", "cutpipe.sim", "cutpipe.runtime", "cutpipe.viz", "cutpipe.plan"),
    "sim": ("torch", "cutpipe.runtime", "cutpipe.viz", "cutpipe.plan"),
    "viz": ("torch", "cutpipe.runtime", "cutpipe.plan"),
}


def test_layers_import_downward_only():
    root = Path(cutpipe.__file__).parent
    for package, forbidden in LAYERS.items():
        for path in (root / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom):
                    names = [node.module or ""]
                else:
                    continue
                for name in names:
                    assert not name.startswith(forbidden), f"{path.name} imports {name}"
