"""What the host does around a step, as hooks the worker calls at each phase whatever the device:
on the CPU, where the forward itself runs on the host's cores, the thread count
(runtime/cpu_threads.py), the OpenMP workers given back (runtime/openmp.py) and the consumers'
hand-off; on a GPU, whose forward leaves the cores free, nothing (DeviceHost)."""

from __future__ import annotations

from typing import Callable

import torch

from . import openmp
from .cpu_threads import CpuThreads
from .loop import Handoff

# How long after sampling, at most, the loop thread leaves the CPU to consumers blocked in fetch
# (loop.Handoff): on 2 cores the 64th consumer holds its token about 2 ms after sampling.
# A consumer slower than that costs its step this much, no more.
CONSUMER_GRACE_S = 0.003


class CpuHost:
    """``threads``: the cap on the forward's OpenMP threads (EngineOptions.cpu_threads);
    ``splits``: see CpuThreads."""

    def __init__(self, threads: int | None, splits: Callable[[object, int], bool] | None):
        self.threads = CpuThreads(threads, splits)
        self.handoff = Handoff()
        # Loading ran on this thread and left it a pool of OpenMP workers; beside the loop
        # thread's own, libgomp would stop letting either spin (see openmp.py).
        openmp.release_thread_pool()

    @property
    def thread_count(self) -> int:
        return self.threads.count

    def before_forward(self, step) -> None:
        self.threads.before_forward(step)

    def after_sampling(self) -> None:
        self.threads.after_sampling()  # its team's workers are asleep again: the load sampled sees others only

    def before_delivery(self, sampling: list) -> None:
        """Outside the lock, before the step's tokens go out to the requests of ``sampling``."""
        if not openmp.SHORT_SPIN:  # its idle workers would spin on the core a consumer needs next (openmp.py)
            openmp.release_thread_pool()
        self.handoff.expect([ctx for ctx in sampling if ctx.consumer_waiting and not ctx.finished])

    def after_delivery(self, produced: float) -> None:
        self.handoff.wait(produced + CONSUMER_GRACE_S)

    def took(self, ctx) -> None:
        """In a consumer's thread: it took an item of ``ctx``'s stream."""
        self.handoff.took(ctx)

    def after_fork_in_child(self) -> None:
        self.handoff = Handoff()  # its lock may have been held by a thread that no longer exists


class DeviceHost:
    """A GPU's forward leaves the host's cores free: nothing to do around it."""

    thread_count = None

    def before_forward(self, step) -> None:
        pass

    def after_sampling(self) -> None:
        pass

    def before_delivery(self, sampling: list) -> None:
        pass

    def after_delivery(self, produced: float) -> None:
        pass

    def took(self, ctx) -> None:
        pass

    def after_fork_in_child(self) -> None:
        pass


def host_for(device: torch.device, threads: int | None, splits) -> CpuHost | DeviceHost:
    return CpuHost(threads, splits) if device.type == "cpu" else DeviceHost()
