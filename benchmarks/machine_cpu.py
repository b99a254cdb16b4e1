"""Where a machine's CPU time goes while a benchmark runs: every process's CPU seconds (user +
system, from psutil), sampled in a thread, then summed over a time window by process.

    with MachineCpu() as cpu:
        ...                                   # the run; note its spans' ends (time.time())
    used, busy = cpu.window(start, end)       # {process: CPU s in [start, end]}, the machine's busy s
    cpu.by_group(spans, cpu.classify(training=is_training))  # {"training": …, "script": …, "others": …, "rest": …, "busy": …}

A process's CPU seconds at an instant are interpolated between the two samples around it (0 at
its start, its last sample after it ends); one that starts and ends between two samples is not
seen, so spans much shorter than the interval are not measured. A process is known by its pid and start time, and
named by the titles it had (Ray's workers retitle themselves with the task or actor they run).
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil


@dataclass(eq=False)  # each sampled process its own key
class Process:
    pid: int
    started: float
    parent: int
    titles: list[str] = field(default_factory=list)  # each distinct title, in the order seen
    times: list[float] = field(default_factory=list)  # sample instants
    cpu: list[float] = field(default_factory=list)  # cumulative CPU s at them

    @property
    def name(self) -> str:
        """A short name: the last Ray task or actor (``ray::Name``) it ran, else its Python
        script's file name, else its program's."""
        ran = [t for t in self.titles if t.startswith("ray::") and t != "ray::IDLE"]
        title = (ran or self.titles)[-1]
        words = title.split()
        if words[0].startswith("ray::"):
            return words[0].split(".")[0]
        if words[0].startswith("ray-dashboard-"):
            return words[0]
        program = Path(words[0]).name
        if program.startswith("python"):
            return next((Path(w).name for w in words[1:] if w.endswith(".py")), program)
        return program

    def cpu_at(self, t: float) -> float:
        if t <= self.started or not self.times:
            return 0.0
        i = bisect.bisect_left(self.times, t)
        if i == len(self.times):
            return self.cpu[-1]
        before_t, before_cpu = (self.times[i - 1], self.cpu[i - 1]) if i else (self.started, 0.0)
        after_t = self.times[i]
        share = (t - before_t) / (after_t - before_t) if after_t > before_t else 1.0
        return before_cpu + share * (self.cpu[i] - before_cpu)


class MachineCpu:
    """Samples every process's CPU seconds, and the machine's busy seconds, every ``interval`` s
    while in its ``with`` block."""

    def __init__(self, interval: float = 0.5):  # a sample: ~6 ms of one core with 65 processes
        self.interval = interval
        self.processes: dict[tuple[int, float], Process] = {}
        self.busy: list[tuple[float, float]] = []  # (instant, the machine's cumulative busy CPU s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="machine-cpu", daemon=True)

    def __enter__(self) -> MachineCpu:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval):
                self.sample()
                return

    def sample(self) -> None:
        machine = psutil.cpu_times()
        now = time.time()
        self.busy.append((now, machine.user + machine.nice + machine.system + machine.irq + machine.softirq
                          + getattr(machine, "steal", 0.0)))
        for proc in psutil.process_iter(["pid", "ppid", "create_time", "cmdline", "name", "cpu_times"]):
            info = proc.info
            if info["cpu_times"] is None or info["create_time"] is None:  # gone, or not ours to read
                continue
            key = (info["pid"], info["create_time"])
            process = self.processes.setdefault(key, Process(info["pid"], info["create_time"], info["ppid"]))
            title = " ".join(info["cmdline"] or []) or f"[{info['name']}]"
            if title not in process.titles:
                process.titles.append(title)
            process.times.append(now)
            process.cpu.append(info["cpu_times"].user + info["cpu_times"].system)

    def window(self, start: float, end: float) -> tuple[dict[Process, float], float]:
        """Each process's CPU seconds in ``[start, end]`` (those that used any), and the machine's
        busy seconds there."""
        used = {p: p.cpu_at(end) - p.cpu_at(start) for p in self.processes.values()}
        times = [t for t, _ in self.busy]

        def busy_at(t: float) -> float:
            i = min(max(bisect.bisect_left(times, t), 1), len(times) - 1)
            (t0, b0), (t1, b1) = self.busy[i - 1], self.busy[i]
            return b0 + (t - t0) / (t1 - t0) * (b1 - b0)

        return {p: s for p, s in used.items() if s > 0}, busy_at(end) - busy_at(start)

    def by_group(self, spans: list[tuple[float, float]], group: Callable[[Process], str]) -> dict[str, float]:
        """CPU seconds over ``spans`` (summed) of each ``group(process)``, and ``"busy"``: the
        machine's busy seconds there."""
        totals = {"busy": 0.0}
        for start, end in spans:
            used, busy = self.window(start, end)
            totals["busy"] += busy
            for process, seconds in used.items():
                totals[group(process)] = totals.get(group(process), 0.0) + seconds
        return totals

    def classify(self, **groups: Callable[[Process], bool]) -> Callable[[Process], str]:
        """A ``group`` for :meth:`by_group`: the first of ``groups`` whose test a process passes,
        else ``"script"`` (this process), ``"others"`` (a process started under it) or ``"rest"``."""
        me = os.getpid()
        ours = self.descendants(me)

        def group(process: Process) -> str:
            return next((name for name, test in groups.items() if test(process)),
                        "script" if process.pid == me else "others" if process.pid in ours else "rest")

        return group

    def descendants(self, pid: int) -> set[int]:
        """``pid`` and every process started under it (as seen by the samples)."""
        children: dict[int, list[int]] = {}
        for p in self.processes.values():
            children.setdefault(p.parent, []).append(p.pid)
        found, todo = set(), [pid]
        while todo:
            current = todo.pop()
            if current not in found:
                found.add(current)
                todo.extend(children.get(current, []))
        return found


def ray_data_task(process: Process) -> bool:
    """Whether ``process`` ran a Ray Data read task (``ray::Read…``: pairsim's reads, fused with the
    decoding that follows them)."""
    return any(title.startswith("ray::Read") for title in process.titles)
