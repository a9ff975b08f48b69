"""What a person watches during a run: a progress line, a JSON-lines log, a profiler trace.

Only rank 0 writes the log and draws the line; every rank may write a profiler trace (one file
per rank), so the pipeline's ranks can be seen side by side in Perfetto.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from cutpipe.train.options import TrainOptions


class MetricsLog:
    """One JSON object per optimizer step: step, loss, lr, grad norm, tokens/s, step time,
    measured bubble, peak activation bytes; a step after which the run evaluated adds
    ``val_loss``, ``val_ppl`` and ``val_time``. A resumed run appends after the steps it keeps."""

    def __init__(self, path: str | None, append: bool = False) -> None:
        self._file = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a" if append else "w")  # noqa: SIM115 (closed in close())

    def write(self, record: Any) -> None:
        """Write a ``StepRecord`` or its dict."""
        if self._file is not None:
            data = record if isinstance(record, dict) else record.to_dict()
            self._file.write(json.dumps(data) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The log's records, the last one of each step (a resumed run repeats some steps)."""
    by_step: dict[int, dict[str, Any]] = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{path}:{number} is not a JSON object: {line[:60]!r}") from None
        if not isinstance(record, dict) or "step" not in record or "loss" not in record:
            raise ValueError(f"{path}:{number}: not a cutpipe metrics record (no step or loss)")
        by_step[int(record["step"])] = record
    return [by_step[step] for step in sorted(by_step)]


class ProgressLine:
    """A rich progress bar: step, loss, tokens/s, measured bubble, the latest validation loss,
    time left."""

    def __init__(self, options: TrainOptions, trainer: Any, resumed: int | None) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self._progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(),
            TextColumn("{task.completed}/{task.total}"), TextColumn("{task.fields[status]}"),
            TimeRemainingColumn(),
        )  # fmt: skip
        self._progress.start()
        title = f"{trainer.task.name}, {trainer.schedule.name} on {trainer.world} ranks"
        if options.emulate:
            title = f"{trainer.schedule.name} on {trainer.world} ranks, emulated"
        if resumed:
            title += f" (resumed after step {resumed})"
        self._validation = ""  # the latest evaluation's, shown until the next
        self._task = self._progress.add_task(
            title, total=options.steps, completed=trainer.step, status=""
        )

    def update(self, record: Any) -> None:
        status = f"loss {record.loss:.4f}  lr {record.lr:.2e}  {record.tokens_per_s:,.0f} tok/s"
        if math.isnan(record.loss) and math.isnan(record.grad_norm):  # emulated: time only
            status = f"step {record.step_time * 1e3:.1f} ms"
        if record.expert_load:  # the worst layer's max/mean tokens per expert
            status += f"  load {max(record.expert_load.values()):.2f}x"
        if record.bubble is not None:
            status += f"  bubble {record.bubble:.1%}"
        if getattr(record, "val_loss", None) is not None:
            self._validation = f"  val {record.val_loss:.4f}"
        status += self._validation
        self._progress.update(self._task, completed=record.step, status=status)

    def close(self) -> None:
        self._progress.stop()


class Profiler:
    """torch.profiler over steps ``A:B`` (1-based, inclusive); one Chrome trace per rank.

    The profiler runs from the first step to ``close`` with torch's step schedule recording only
    the window: stopping it while the runner's background threads run can crash the process.
    """

    def __init__(self, options: TrainOptions, rank: int, first_step: int = 1) -> None:
        self._profile: Any = None
        if options.profile_steps is None:
            return
        import torch
        from torch.profiler import ProfilerActivity, profile, schedule

        first, last = options.profile_steps
        directory = options.profile_dir

        def export(finished: Any) -> None:
            os.makedirs(directory, exist_ok=True)
            finished.export_chrome_trace(os.path.join(directory, f"rank{rank}.json"))

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        before = max(0, first - first_step)  # steps to skip; the last of them warms up
        warmup = min(1, before)
        self._profile = profile(
            activities=activities,
            schedule=schedule(
                wait=before - warmup, warmup=warmup, active=last - max(first, first_step) + 1,
                repeat=1,
            ),
            on_trace_ready=export,
        )  # fmt: skip
        self._profile.__enter__()

    def step(self) -> None:
        """One optimizer step ended."""
        if self._profile is not None:
            self._profile.step()

    def close(self) -> None:
        if self._profile is not None:
            self._profile.__exit__(None, None, None)
            self._profile = None
