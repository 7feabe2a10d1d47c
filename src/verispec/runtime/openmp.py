"""OpenMP thread pools when compute moves to another thread.

GNU OpenMP (libgomp: torch's, and so the C kernels', which bind to the copy torch loaded) keeps a
pool of worker threads per thread that ever started a parallel region. Workers spin between
regions while the pooled threads are no more than the cores; past that, libgomp throttles the
spin (about a thousand iterations instead of 300,000), so every worker sleeps on a futex after
each region and must be woken for the next. A decode step runs a hundred-odd regions (every
linear and attention of every layer), and sleeping workers cost about 8 ms a step (24 ms
against 16 ms for a one-token step of the embedded model on 2 cores, with some 70,000 context
switches where spinning workers cause 1,400).

That is what happens when a program loads the model on its main thread (whose pool stays) and
then computes on another (the server's worker thread): two pools on two cores. The thread that
is done computing gives its pool back (`release_thread_pool`, OpenMP 5's
`omp_pause_resource_all`, which libgomp implements by freeing the calling thread's pool), and
the pools in use stay within the cores.
"""

from __future__ import annotations

import ctypes
import sys

OMP_PAUSE_SOFT = 1  # omp_pause_soft: free the threads, keep what a later region re-creates cheaply


def loaded_runtimes() -> list[str]:
    """Paths of the libgomp copies mapped into this process (Linux; elsewhere none found)."""
    if not sys.platform.startswith("linux"):
        return []
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line and "/" in line}
    except OSError:
        return []
    return sorted(paths)


def release_thread_pool() -> list[str]:
    """Free the calling thread's OpenMP worker threads in every loaded libgomp (a later parallel
    region on this thread starts a new pool). Call it on a thread that will stop computing,
    before another takes over. Returns the runtimes that released their pool; none where the
    runtime is not libgomp, lacks OpenMP 5's pause (GCC < 9), or this thread is inside a
    parallel region."""
    released = []
    for path in loaded_runtimes():
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        if pause(OMP_PAUSE_SOFT) == 0:
            released.append(path)
    return released
