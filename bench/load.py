"""How busy the rest of the machine is while the benchmark measures, and waiting for quiet.

The CPU time of the whole machine comes from ``/proc/stat`` (all CPUs, every state but idle and
iowait), this process's own from ``getrusage`` (all its threads). Their difference over a wall-time
interval is the CPU the other processes used, in cores (0 to the number of CPUs). With two threads
on two cores, any other busy process takes a core from a parallel region, and a thread waiting at a
barrier for a descheduled sibling costs whole scheduler ticks: timings then grow by multiples of a
few milliseconds. Each configuration's rows record this number so noisy ones can be told apart.
"""
import os
import resource
import time

_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_busy_s():
    try:
        with open("/proc/stat") as f:
            parts = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return None
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)
    return (sum(parts[:8]) - idle) / _HZ


def _own_s():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class OthersMeter:
    """``with OthersMeter() as m: ...`` then ``m.cores``: CPU cores other processes used."""

    def __enter__(self):
        self._t, self._busy, self._own = time.perf_counter(), _machine_busy_s(), _own_s()
        self.cores = float("nan")
        return self

    def __exit__(self, *exc):
        busy = _machine_busy_s()
        wall = time.perf_counter() - self._t
        if busy is not None and self._busy is not None and wall > 0:
            self.cores = max(0.0, (busy - self._busy - (_own_s() - self._own)) / wall)


def others_now(window=0.5):
    """Cores used by other processes over the next ``window`` seconds (this one sleeps)."""
    with OthersMeter() as m:
        time.sleep(window)
    return m.cores


def wait_quiet(max_wait, threshold=0.3, window=0.5):
    """Sleep until other processes use less than ``threshold`` cores, at most ``max_wait``
    seconds; returns the seconds waited."""
    start = time.perf_counter()
    while time.perf_counter() - start < max_wait:
        if not others_now(window) >= threshold:
            break
    return time.perf_counter() - start


__all__ = ["OthersMeter", "others_now", "wait_quiet"]
