"""Shared helpers for the benchmark scripts: machine description and timing."""

from __future__ import annotations

import os
import platform

import torch


def machine() -> str:
    cpu = "unknown cpu"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB, {platform.system()} {platform.machine()}, "
            f"torch {torch.__version__}")


def median_us(fn, repeat: int = 2000, warmup: int = 100) -> float:
    """Median wall time of one call, in microseconds (the timing loop lives in neffbuild.bench)."""
    from neffbuild.bench.overhead import median_seconds

    return median_seconds(fn, repeat, warmup) * 1e6


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
