"""When each request of a benchmark is sent: all at once, or a (bursty) Poisson process.

As in `vllm bench serve`: gaps are gamma-distributed with shape
`burstiness` and mean 1/request_rate (burstiness 1 is Poisson; < 1 is
burstier, > 1 more regular, inf is a fixed interval), and the schedule is
rescaled so the last request goes out at exactly num_requests / rate. That
bounds the whole schedule and keeps throughput comparable across seeds.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import AsyncIterator, Callable, Sequence, TypeVar

import numpy as np

T = TypeVar("T")


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times in seconds after the start, non-decreasing; the last is num_requests / rate."""
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be positive (or inf), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be positive, got {burstiness}")
    if num_requests == 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if math.isinf(burstiness):
        gaps = np.full(num_requests, 1.0 / request_rate)
    else:
        rng = np.random.default_rng(seed)
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)
    t = np.cumsum(gaps)
    if t[-1] > 0:
        t *= (num_requests / request_rate) / t[-1]
    return [float(x) for x in t]


async def paced(
    items: Sequence[T], offsets: Sequence[float], clock: Callable[[], float] = time.perf_counter
) -> AsyncIterator[tuple[int, T]]:
    """Yield (index, item) at start + offsets[index]; finite because the schedule is."""
    if len(items) != len(offsets):
        raise ValueError(f"{len(items)} items but {len(offsets)} send times")
    start = clock()
    for i, item in enumerate(items):
        wait = start + offsets[i] - clock()
        if wait > 0:
            await asyncio.sleep(wait)
        yield i, item
