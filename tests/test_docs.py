"""Every code block in README.md and docs/*.md runs as written, or is marked as not meant to.

The markers (an HTML comment on the line right above the fence; docs/architecture.md, "Docs that
run"):

- none, on a ```python or ```bash block: run it in a fresh interpreter or shell;
- ``<!-- run: torchrun N -->``: a Python block that runs under ``torch.distributed.run`` on N
  processes;
- ``<!-- output: COMMAND -->``: the block is part of what COMMAND prints (a line ending in " ..."
  stands for its own beginning);
- ``<!-- synopsis -->``: usage lines; every option each ``cutpipe`` line names must exist;
- ``<!-- excerpt: REASON -->``: not run, for the reason given.

Everything runs in a scratch folder that holds a link to ``examples/`` and an empty
``docs/figures/``, so the docs' paths work there and every file they write stays there.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(```+)\s*([\w-]*)\s*$")
COMMENT = re.compile(r"^<!--(.*)-->\s*$")
MARKER = re.compile(r"^\s*(excerpt|output|run|synopsis)\s*(?::\s*(.*?))?\s*$")
TORCHRUN = re.compile(r"torchrun (\d+)")
RUNS = ("python", "bash")
CUTPIPE = str(Path(sys.executable).with_name("cutpipe"))  # this interpreter's command
TIMEOUT = 180  # seconds for one block; the slowest (two `cutpipe train` runs) takes about 35


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # the opening fence's, from 1
    language: str
    marker: str  # "" when unmarked
    argument: str
    text: str
    problem: str = ""  # a malformed marker

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def parse(page: Path) -> list[Block]:
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(
            (j for j in range(i + 1, len(lines)) if lines[j].rstrip() == fence.group(1)), None
        )
        if end is None:
            raise AssertionError(f"{page.relative_to(ROOT)}:{i + 1}: the block is never closed")
        marker, argument, problem = "", "", ""
        comment = COMMENT.match(lines[i - 1]) if i else None
        if comment:
            known = MARKER.match(comment.group(1))
            if known:
                marker, argument = known.group(1), known.group(2) or ""
            else:
                problem = f"unknown marker <!--{comment.group(1)}-->"
        text = "\n".join(lines[i + 1 : end]) + "\n"
        blocks.append(Block(page, i + 1, fence.group(2), marker, argument, text, problem))
        i = end + 1
    return blocks


BLOCKS = [block for page in PAGES for block in parse(page)]
CHECKED = [block for block in BLOCKS if block.marker != "excerpt"]


def test_every_page_has_blocks_and_every_marker_sits_on_a_block():
    assert {block.page for block in BLOCKS} >= {ROOT / "README.md", ROOT / "docs" / "runtime.md"}
    fenced = {(block.page, block.line - 1) for block in BLOCKS}
    for page in PAGES:
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines()):
            comment = COMMENT.match(line)
            if comment and MARKER.match(comment.group(1)):
                assert (page, number + 1) in fenced, (
                    f"{page.relative_to(ROOT)}:{number + 1}: a marker with no code block below it"
                )


def test_excerpts_say_why():
    for block in BLOCKS:
        if block.marker == "excerpt":
            assert len(block.argument.split()) >= 2, f"{block.name}: say why it is not run"


def sandbox(tmp_path: Path) -> dict[str, str]:
    """Prepare ``tmp_path`` to run doc commands in; return their environment."""
    (tmp_path / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
    (tmp_path / "benchmarks").symlink_to(ROOT / "benchmarks", target_is_directory=True)
    (tmp_path / "docs" / "figures").mkdir(parents=True)
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["COLUMNS"] = "80"  # rich's width off a terminal, whatever the caller's terminal is
    env.pop("CUTPIPE_DEBUG", None)
    return env


def run(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    result = subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT, check=False
    )
    if result.returncode != 0:
        pytest.fail(
            f"exit status {result.returncode}\n--- stdout\n{result.stdout[-4000:]}"
            f"\n--- stderr\n{result.stderr[-8000:]}",
            pytrace=False,
        )
    return result


def shell(command: str) -> list[str]:
    return ["bash", "-euo", "pipefail", "-c", command]


def contains(output: list[str], expected: list[str]) -> bool:
    """``expected`` appears as consecutive lines of ``output``; "X ..." matches any line
    beginning with X."""

    def same(line: str, want: str) -> bool:
        if want.endswith(" ..."):
            return line.startswith(want[: -len("...")])
        return line == want

    n = len(expected)
    return any(
        all(
            same(line, want) for line, want in zip(output[start : start + n], expected, strict=True)
        )
        for start in range(len(output) - n + 1)
    )


@cache
def options_of(command: tuple[str, ...]) -> set[str]:
    result = subprocess.run(
        [CUTPIPE, *command, "--help"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, f"cutpipe {' '.join(command)} --help: {result.stderr}"
    return set(re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", result.stdout))


def synopsis(text: str) -> list[tuple[tuple[str, ...], list[str]]]:
    """(subcommand words, options) per ``cutpipe`` line; indented lines continue the last one."""
    commands: list[tuple[tuple[str, ...], list[str]]] = []
    for line in text.splitlines():
        if line.startswith("cutpipe "):
            words = []
            for word in line.split()[1:]:
                if not re.fullmatch(r"[a-z]+", word):
                    break
                words.append(word)
            commands.append((tuple(words), []))
        elif not line.startswith(" ") or not commands:
            continue
        commands[-1][1].extend(re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", line))
    return commands


@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.parametrize("block", CHECKED, ids=[block.name for block in CHECKED])
def test_block(block: Block, tmp_path: Path):
    assert not block.problem, f"{block.name}: {block.problem}"
    if block.marker == "synopsis":
        commands = synopsis(block.text)
        assert commands, f"{block.name}: no `cutpipe` line in the synopsis"
        for words, options in commands:
            missing = sorted(set(options) - options_of(words))
            assert not missing, f"{block.name}: `cutpipe {' '.join(words)}` has no {missing}"
        return
    env = sandbox(tmp_path)
    if block.marker == "output":
        assert block.argument, f"{block.name}: say which command prints it"
        printed = run(shell(block.argument), tmp_path, env).stdout
        lines = [line.rstrip() for line in printed.splitlines()]
        expected = [line.rstrip() for line in block.text.splitlines()]
        assert contains(lines, expected), (
            f"{block.name}: `{block.argument}` printed\n{printed}\nnot\n{block.text}"
        )
        return
    if block.marker == "run":
        processes = TORCHRUN.fullmatch(block.argument)
        assert processes and block.language == "python", (
            f"{block.name}: `run:` takes `torchrun N` on a python block"
        )
        script = tmp_path / "block.py"
        script.write_text(block.text, encoding="utf-8")
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        run([*launcher, "--nproc-per-node", processes.group(1), script.name], tmp_path, env)
        return
    if block.language not in RUNS:
        pytest.fail(
            f"{block.name}: a ```{block.language} block runs only as python or bash; mark it "
            "<!-- excerpt: why -->, <!-- output: COMMAND --> or <!-- synopsis -->",
            pytrace=False,
        )
    if block.language == "python":
        script = tmp_path / "block.py"
        script.write_text(block.text, encoding="utf-8")
        run([sys.executable, script.name], tmp_path, env)
    else:
        run(shell(block.text), tmp_path, env)
