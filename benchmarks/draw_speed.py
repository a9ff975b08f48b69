"""How fast cutpipe draws a large timeline: R = 32, m = 256 (ZB-H1, 24,576 boxes).

Builds the scene once, then writes PNG, SVG, HTML and a Chrome trace, each timed (median of
``--rounds``). Targets: PNG under 5 s and HTML under 2 s, scene included.

    python benchmarks/draw_speed.py [--ranks 32] [--microbatches 256] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from cutpipe import generate, simulate
from cutpipe.viz import chrome_trace, html, png, scene


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="zbh1")
    parser.add_argument("--ranks", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    timeline = simulate(generate(args.schedule, args.ranks, args.microbatches))
    writers = {".png": png.save, ".svg": png.save, ".html": html.save, ".json": chrome_trace.save}
    seconds: dict[str, list[float]] = {"scene": [], **{suffix: [] for suffix in writers}}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.rounds):
            start = time.perf_counter()
            drawn = scene([timeline])
            seconds["scene"].append(time.perf_counter() - start)
            for suffix, write in writers.items():
                start = time.perf_counter()
                write(drawn, Path(folder) / f"timeline{suffix}")
                seconds[suffix].append(time.perf_counter() - start)
    base = statistics.median(seconds["scene"])
    print(
        f"{args.schedule} R={args.ranks} m={args.microbatches}: {drawn.box_count} boxes, median of {args.rounds}"
    )
    print(f"  scene            {base:.2f} s")
    for suffix in writers:
        total = base + statistics.median(seconds[suffix])
        print(f"  {suffix:<5} with scene {total:.2f} s")


if __name__ == "__main__":
    main()
