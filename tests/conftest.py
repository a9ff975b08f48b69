"""Shared hypothesis settings and strategies."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from cutpipe.schedule.registry import SCHEDULES
from cutpipe.sim.costs import Costs

settings.register_profile(
    "default", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "thorough", max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def pytest_configure(config) -> None:
    """Set before the test modules copy the environment for their subprocesses. Costs the
    trainer measures are cached (``cutpipe.train.balance``): in a folder of this session's."""
    config.cutpipe_cache = tempfile.mkdtemp(prefix="cutpipe-test-cache-")
    os.environ["XDG_CACHE_HOME"] = config.cutpipe_cache
    # One thread per process, here and in every process a test starts: the tests run many
    # processes on a small shared machine, where OpenMP's spinning threads fight each other and
    # whatever else runs for the cores (in-process tests ran 1.7x slower with one core busy).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_unconfigure(config) -> None:
    if hasattr(config, "cutpipe_cache"):
        shutil.rmtree(config.cutpipe_cache, ignore_errors=True)


NAMES = tuple(SCHEDULES)


@st.composite
def valid_shapes(draw, name: str, max_ranks: int = 10, extra_microbatches: int = 24):
    """(ranks, microbatches) inside ``name``'s documented valid range."""
    info = SCHEDULES[name]
    ranks = draw(st.integers(1, max_ranks).filter(lambda r: not (info.even_ranks and r % 2)))
    low = info.min_microbatches(ranks)
    return ranks, draw(st.integers(low, low + extra_microbatches))


@st.composite
def named_shapes(draw, max_ranks: int = 10, extra_microbatches: int = 24):
    """(name, ranks, microbatches) for any generator, inside its valid range."""
    name = draw(st.sampled_from(NAMES))
    return (name, *draw(valid_shapes(name, max_ranks, extra_microbatches)))


@st.composite
def capped_problems(draw, kinds=("linear", "v"), max_ranks: int = 5, max_extra: int = 8):
    """A memory-capped search problem: (placement kind, ranks, microbatches (2R and up), integer
    costs with communication, the cap as a factor of 1F1B's peak from the frontier's)."""
    from cutpipe.plan.search.frontier import FACTORS
    from cutpipe.sim.costs import Costs

    kind = draw(st.sampled_from(kinds))
    ranks = draw(st.integers(2, max_ranks))
    m = 2 * ranks + draw(st.integers(0, max_extra))
    f, b, w = (draw(st.integers(1, 9)) for _ in range(3))
    costs = Costs(f=f, b=b, w=w, comm=draw(st.integers(0, 3)))
    return kind, ranks, m, costs, draw(st.sampled_from(FACTORS))


#: Costs that add up exactly in binary floating point, so closed forms can be checked with ==.
dyadic = st.integers(1, 16).map(lambda k: k / 4)


@st.composite
def cost_models(draw):
    """Costs with every timing field drawn: dyadic op times, communication, exposed
    expert-parallel time and overlapped pairs."""
    return Costs(
        f=draw(dyadic),
        b=draw(dyadic),
        w=draw(dyadic),
        fb=draw(st.none() | dyadic.map(lambda x: x * 2)),
        comm=draw(st.sampled_from([0.0, 0.25, 1.0])),
        ep_f=draw(st.sampled_from([0.0, 0.5, 2.0])),
        ep_b=draw(st.sampled_from([0.0, 0.5, 2.0])),
        w_memory=draw(st.sampled_from([0.0, 0.5, 1.0])),
    )


CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


def headless_chromium(profile_dir, width: int, height: int) -> Iterator:
    """A headless Chromium driven by selenium at this window size (skips the test where
    Debian's chromium and chromium-driver are missing; .ci/run installs them)."""
    import pytest

    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip(
            "Debian's chromium and chromium-driver are not installed (.ci/run installs them)"
        )
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", f"--window-size={width},{height}",
                 f"--user-data-dir={profile_dir}"):  # fmt: skip
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(
        options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER)
    )
    yield driver
    driver.quit()
