"""The benchmark scripts' end-to-end CPU runs that only guard a device call (several processes or fresh
compiles: ~110 s of the suite's 6-minute budget): run with ``KLPPO_TEST_BENCH=1`` before a device call that
uses the script; the scripts' pieces keep their own fast tests in the default suite."""

from __future__ import annotations

import os

import pytest

device_bench_run = pytest.mark.skipif(
    not os.environ.get("KLPPO_TEST_BENCH"),
    reason="a benchmark script's end-to-end CPU run, kept out of the default suite for time: "
    "KLPPO_TEST_BENCH=1 runs it",
)
