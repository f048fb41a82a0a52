"""One timing module for `perfx bench`, the tuner and the pytest-benchmark suite.

Kernels are timed with profiling events (device time, not Python time): warm-up launches, then
repeated launches, the median reported with every sample kept. The device's memory ceilings are measured here
too: copy bandwidth (read and write) and the read-only stream. The events come from the device's profiling
queue (``Device.profiling``), which a timing enters itself; the queue a model decodes on records none. Where a
case holds several copies of its inputs, they are rotated between launches so that caches do not flatter the
figure.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from perfx.errors import PerfxError
from perfx.runtime import Device


@dataclass
class Timing:
    median_s: float
    samples: list[float] = field(default_factory=list)

    @property
    def spread(self) -> float:
        """(max − min) / median of the samples: how much to trust the median."""
        if len(self.samples) < 2 or self.median_s <= 0:
            return 0.0
        return (max(self.samples) - min(self.samples)) / self.median_s

    def as_dict(self) -> dict:
        return {"median_s": self.median_s, "spread": self.spread, "samples_s": self.samples}


def device_time(events) -> float:
    """Seconds the device spent on the launches: each event's start to its end, summed. Not the span from the
    first start to the last end: a product of several launches (x quantized first, attention's partitions and
    their combine) is enqueued by Python one launch at a time, and the device idles while the host prepares the
    next one, where a decode step replays its launches back to back (`benchmarks/NOTES.md`). The
    first launch after the host's wait also carries the runtime's wake-up, once per measurement, as a
    one-launch candidate's does."""
    total = 0.0
    for event in events:
        event.wait()
        total += Device.event_seconds(event)
    return total


def _device_of(events) -> Device:
    """The Device whose queue ``events`` (a launch function's result) were enqueued on."""
    device = Device.of_events(events)
    if device is None:
        raise PerfxError("time_launches: the launch function returned no event of a perfx Device's launch; "
                         "return the events of the launches to time, or pass device=")
    return device


def time_launches(launch: Callable[[], list], warmup: int = 2, repeat: int = 10,
                  rotate: Callable[[], None] | None = None, max_seconds: float | None = None,
                  device: Device | None = None) -> Timing:
    """Median device time of ``launch()`` (which enqueues and returns its events), on ``device``'s profiling
    queue (``Device.profiling``); without ``device``, the device whose queue a first, untimed ``launch()``
    ran on.

    ``max_seconds`` cuts the repeats short once that much wall time has passed (the tuner uses it to
    stop timing a candidate that is clearly slower than the best so far); at least one sample is taken.
    """
    if device is None:
        device = _device_of(launch())
    with device.profiling():
        for _ in range(warmup):
            device_time(launch())
        samples = []
        started = time.perf_counter()
        for _ in range(repeat):
            if rotate is not None:
                rotate()
            samples.append(device_time(launch()))
            if max_seconds is not None and time.perf_counter() - started > max_seconds:
                break
    return Timing(statistics.median(samples), samples)


def _copy_launcher(device: Device, nbytes: int, copies: int) -> Callable[[], list]:
    """A launch function of our copy kernel over ``copies`` source/destination pairs of ``nbytes``, rotated."""
    vw = 8 if device.caps.vendor_key == "pocl" else 4   # PoCL gets its bandwidth from wide types only
    kernel = device.kernel("copy.cl", "copy_vectors", {"VWC": vw})
    n = nbytes // (4 * vw)
    rng = np.random.default_rng(0)
    pairs = [(device.upload(rng.standard_normal(nbytes // 4, dtype=np.float32)), device.empty(nbytes // 4, np.float32))
             for _ in range(copies)]
    state = {"i": 0}
    global_size = min(n, device.caps.compute_units * 2048) // 64 * 64 or 64

    def launch():
        src, dst = pairs[state["i"] % copies]
        state["i"] += 1
        return [device.launch(kernel, (global_size,), (64,), np.int32(n), src.data, dst.data)]
    return launch


def copy_bandwidth(device: Device, nbytes: int = 64 << 20, copies: int = 2, repeat: int = 10) -> tuple[float, Timing]:
    """The device's copy bandwidth in GB/s (bytes read + written), measured with our copy kernel.

    ``copies`` source/destination pairs are rotated so a large cache (a data-centre GPU's L2) does not
    serve the reads.
    """
    nbytes = min(nbytes, device.caps.max_alloc) // 32 * 32
    timing = time_launches(_copy_launcher(device, nbytes, copies), warmup=2, repeat=repeat, device=device)
    return 2 * nbytes / timing.median_s / 1e9, timing


STREAM_WGS = 64   # kernels/stream_read.cl's work-group


def stream_read_width(device: Device) -> int:
    """Floats a work-item of ``stream_read`` loads at once (VWR): PoCL gets its bandwidth from wide types only."""
    return 8 if device.caps.vendor_key == "pocl" else 4


def stream_read_groups(device: Device, count: int) -> int:
    """Work-groups ``stream_read`` launches over ``count`` floats: as many work-items as the copy kernel's, at
    most one a vector, whole work-groups of ``STREAM_WGS``."""
    vectors = count // stream_read_width(device)
    return max(1, min(vectors, device.caps.compute_units * 2048) // STREAM_WGS)


def stream_read(device: Device, src, sums, count: int):
    """Enqueue kernels/stream_read.cl over ``count`` floats of the float32 device array ``src``: sums[g] = the sum of
    the floats work-group g reads (which ones: the file's shape contract), for the ``stream_read_groups`` work-groups;
    returns the event."""
    kernel = device.kernel("stream_read.cl", "stream_read", {"VWR": stream_read_width(device), "WGS": STREAM_WGS})
    groups = stream_read_groups(device, count)
    return device.launch(kernel, (groups * STREAM_WGS,), (STREAM_WGS,), np.int32(count), src.data, sums.data)


def read_bandwidth(device: Device, nbytes: int = 64 << 20, copies: int = 2, repeat: int = 10) -> tuple[float, Timing]:
    """The device's read-only stream bandwidth in GB/s (bytes read, and the few written), measured with
    kernels/stream_read.cl: a decode GEMV reads its weight and writes a vector, so this is the ceiling it could
    reach, where copy's (``copy_bandwidth``) also writes what it reads.

    The sources rotate as copy's pairs do, at least ``copies`` of them and enough that together they exceed
    twice the device's largest cache, so no read is served from it.
    """
    nbytes = min(nbytes, device.caps.max_alloc) // 32 * 32
    count = nbytes // 4
    past_cache = -(-2 * device.caps.cache_bytes // nbytes)
    copies = max(copies, min(past_cache, device.caps.global_mem // 4 // nbytes))
    rng = np.random.default_rng(0)
    sources = [device.upload(rng.standard_normal(count, dtype=np.float32)) for _ in range(copies)]
    sums = device.empty(stream_read_groups(device, count), np.float32)
    state = {"i": 0}

    def launch():
        src = sources[state["i"] % copies]
        state["i"] += 1
        return [stream_read(device, src, sums, count)]
    timing = time_launches(launch, warmup=2, repeat=repeat, device=device)
    return (nbytes + sums.nbytes) / timing.median_s / 1e9, timing


def bootstrap_ratio(numerator, denominator, rng: np.random.Generator, resamples: int = 2000,
                    confidence: float = 0.95) -> tuple[float, float, float]:
    """median(numerator) / median(denominator) of paired samples (round i of each was taken together), and
    its bootstrap interval: rounds resampled with replacement, the ratio of medians each time."""
    a, b = np.asarray(numerator, dtype=np.float64), np.asarray(denominator, dtype=np.float64)
    if a.shape != b.shape or a.size == 0:
        raise ValueError(f"paired samples of the same non-zero length, got {a.size} and {b.size}")
    point = float(np.median(a) / np.median(b))
    picks = rng.integers(0, a.size, (resamples, a.size))
    ratios = np.median(a[picks], axis=1) / np.median(b[picks], axis=1)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(ratios, [tail, 100 - tail])
    return point, float(low), float(high)


def copy_kernel(device: Device, nbytes: int = 8 << 20) -> Callable[[], float]:
    """A reference kernel for drift checks: a function that times one copy of ``nbytes`` (median of 3),
    about a millisecond, over two buffer pairs so a phone GPU's caches do not serve it."""
    launch = _copy_launcher(device, min(nbytes, device.caps.max_alloc) // 32 * 32, 2)
    return lambda: time_launches(launch, warmup=1, repeat=3, device=device).median_s
