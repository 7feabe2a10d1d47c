"""runtime/openmp.py: a thread that stops computing gives its OpenMP worker threads back, so the
pools in use stay within the cores (else libgomp puts every worker to sleep between regions)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from verispec.runtime.openmp import loaded_runtimes, release_thread_pool

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc (Linux)")


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _wait_for(condition) -> bool:
    for _ in range(500):  # pool threads exit just after the release returns
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def test_a_thread_releases_the_pool_its_parallel_regions_started():
    seen = {}

    def compute_then_release():
        torch.set_num_threads(4)  # a pool of 3 workers beside this thread, whatever the cores
        a = torch.randn(512, 512)
        for _ in range(3):
            a @ a  # parallel regions: this thread's pool starts
        seen["with pool"] = _threads()
        seen["released"] = release_thread_pool()

    before = _threads()
    thread = threading.Thread(target=compute_then_release)
    thread.start()
    thread.join()
    assert any("gomp" in path for path in loaded_runtimes()), "torch's CPU build runs on libgomp"
    assert seen["released"], "libgomp freed the calling thread's pool"
    assert seen["with pool"] >= before + 1 + 3  # the thread and its 3 workers
    assert _wait_for(lambda: _threads() <= before), "the pool's workers exited with the release"


def test_the_server_worker_releases_the_starting_threads_pool(monkeypatch):
    from verispec.server import worker as worker_module

    calls = []
    monkeypatch.setattr(worker_module, "release_thread_pool", lambda: calls.append(threading.current_thread()))
    monkeypatch.setattr(worker_module.Worker, "_run", lambda self: None)
    worker = worker_module.Worker.__new__(worker_module.Worker)
    worker._thread = None
    worker.start()
    worker._thread.join()
    assert calls == [threading.current_thread()]
