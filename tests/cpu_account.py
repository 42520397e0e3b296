"""CPU-seconds per test module, printed at the end of a run: where `make test`'s 20 minutes go on a 2-core host.

``--durations`` reports wall time, and on a host whose cores are saturated (every full run here) a test's wall
time is mostly waiting for the CPU its neighbours hold: a 1-graph compile showed 196 s of setup. What sets the
suite's length is the CPU it burns, so each xdist worker counts, for every test (setup, call and teardown),
the CPU of its own process and of its descendants: live ones by the growth of their counters (their reaped
children included) since they were last seen (a warm compile pool, a module's vLLM server), reaped ones by the
growth of their reaper's children counters less what was already counted of them while alive. Processes that
init reaps (orphans) or that are not descendants (Ray's workers) are missed: the figure is a floor.
The worker sends it in the test's teardown report (``user_properties``);
the controller adds them up per module.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict

import pytest

KEY = "cpu_s"


class _Meter:
    """The CPU-seconds this process and its descendants used since the last ``take``."""

    def __init__(self):
        import psutil

        self.psutil, self.me = psutil, psutil.Process()
        self.seen: dict[int, tuple[float, float]] = {}  # pid -> (create_time, cpu counted so far)
        self.own = self._own()
        self.take()

    def _own(self) -> tuple[float, float]:
        t = os.times()
        return t.user + t.system, t.children_user + t.children_system

    def take(self) -> float:
        used, alive = 0.0, {}
        try:
            children = self.me.children(recursive=True)
        except self.psutil.Error:
            children = []
        for proc in children:
            try:
                key, cpu = proc.create_time(), sum(proc.cpu_times()[:4])
            except self.psutil.Error:
                continue
            before = self.seen.get(proc.pid)
            used += cpu - (before[1] if before and before[0] == key else 0.0)
            alive[proc.pid] = (key, cpu)
        gone = sum(cpu for pid, (_, cpu) in self.seen.items() if pid not in alive)
        own, reaped = self._own()
        # A reaped process's whole CPU joins its reaper's children counters (this process's, or a live
        # descendant's, both counted above): what was already counted of it while it was alive comes off.
        used += (own - self.own[0]) + (reaped - self.own[1]) - gone
        self.own, self.seen = (own, reaped), alive
        return max(0.0, used)


_meter: _Meter | None = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _meter
    if _meter is None:
        _meter = _Meter()
    else:
        _meter.take()  # CPU between tests (collection, a previous test's stragglers) is nobody's
    item.user_properties.append(("t0", round(time.time(), 2)))  # when it started: the run's timeline, per worker
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "teardown" and _meter is not None:
        outcome.get_result().user_properties.extend(
            [(KEY, round(_meter.take(), 2)), ("t1", round(time.time(), 2)),
             ("worker", os.environ.get("PYTEST_XDIST_WORKER", "-"))])


_per_module: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report):
    for name, value in report.user_properties:
        if name == KEY and report.when == "teardown":
            _per_module[report.nodeid.split("::")[0]] += value


def pytest_terminal_summary(terminalreporter):
    if not _per_module or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    total = sum(_per_module.values())
    terminalreporter.write_sep("=", f"CPU-seconds by module (a floor; all modules: {total:.0f})")
    for module, cpu in sorted(_per_module.items(), key=lambda kv: -kv[1])[:20]:
        terminalreporter.write_line(f"{cpu:9.1f}s  {module}")
