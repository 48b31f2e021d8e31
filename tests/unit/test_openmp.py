"""Releasing a thread's OpenMP workers lets another thread's workers spin between operators."""

import subprocess
import sys
import textwrap

import pytest
import torch

# In a fresh interpreter: no other thread of the test session may hold an OpenMP pool.
PROBE = textwrap.dedent("""
    import resource, threading, torch
    from runtime import openmp
    x = torch.ones(1 << 21)

    def sleeps_of_workers_in_a_new_thread():
        counts = []
        def work():
            x.add_(1)  # this thread's pool starts here
            before = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
            for _ in range(200):
                x.add_(1)  # one parallel region each
            counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - before)
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
        return counts[0]

    x.add_(1)  # the main thread keeps a pool, as a thread that loaded a model does
    beside_another_pool = sleeps_of_workers_in_a_new_thread()
    released = openmp.release_thread_pool()
    alone = sleeps_of_workers_in_a_new_thread()
    print(released, beside_another_pool, alone)
""")


def test_a_released_pool_no_longer_throttles_another_threads_workers():
    if torch.get_num_threads() < 2:
        pytest.skip("one intra-op thread: no OpenMP workers to spin")
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    released, beside_another_pool, alone = out.split()
    if released != "True":
        pytest.skip("torch does not run on libgomp here")
    # Throttled, the worker sleeps after (nearly) every one of the 200 regions; spinning, hardly ever.
    assert int(beside_another_pool) >= 100
    assert int(alone) < int(beside_another_pool) // 4
