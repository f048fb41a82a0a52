"""kernels/sample.cl from two sources side by side: what each costs the compiler, and its run time.

    python benchmarks/sample_sort_sites.py compile OLD.cl NEW.cl [--devices pocl intel] [--topk 64 128] [--rounds 2]
    python benchmarks/sample_sort_sites.py time OLD.cl NEW.cl [--devices pocl intel] [--v 49152 151936] [--rounds 5]

(``--pocl-icd FILE``: the PoCL processes of ``compile`` with OCL_ICD_VENDORS=FILE; for ``time``, set it yourself.)

``compile``: each (source, device, TOPK) in a fresh process with empty pyopencl and PoCL caches, interleaved
round by round: the CPU seconds (``getrusage`` of the process, the driver's threads counted) of the program's
build, then of sample_partial's first launch (PoCL compiles a kernel's work-group function there), then
sample_final's. GROUPS at the spec's default.

``time``: both sources built in one process; each round times sample_partial and sample_final (profiling events,
the median of ``--repeat`` launches after warm-up) for every source in turn, the rounds
interleaved; the medians over rounds and the (min, max) of the last source over the first per round. Logits:
normal × 3 with a 256-id history and a penalty of 1.3 (the common path: two sorts a group), and "lanes": a quarter
of each group's work-items holding all the large logits (tests/test_sample.py), so that the third scan's tiles
run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile

import numpy as np

OPTIONS = ["-cl-mad-enable", "-cl-no-signed-zeros"]   # perfx.runtime.build_options without PERFX_BUILD_OPTIONS


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Program:
    """One source's sample kernels with the buffers of a launch at (v, TOPK, GROUPS)."""

    def __init__(self, cl, context, source: str, topk: int, groups: int):
        with open(source) as f:
            self.program = cl.Program(context, f.read()).build(
                options=[f"-DTOPK={topk}", f"-DGROUPS={groups}", *OPTIONS])
        self.partial = self.program.sample_partial
        self.final = self.program.sample_final
        self.topk, self.groups = topk, groups

    def launch(self, cl, queue, bufs, v: int, h: int, penalty: float):
        partial = cl.enqueue_nd_range_kernel(queue, self._args(self.partial, np.int32(v), bufs["logits"],
                                             bufs["history"], np.int32(h), np.float32(penalty),
                                             np.float32(1 / 0.7), bufs["keys"], bufs["max"], bufs["sum"]),
                                             (self.groups * self.topk,), (self.topk,))
        final = cl.enqueue_nd_range_kernel(queue, self._args(self.final, np.int32(v), bufs["keys"], bufs["max"],
                                           bufs["sum"], np.float32(1 / 0.7), np.int32(0), np.int32(40),
                                           np.float32(0.95), np.float32(0.05), np.uint32(1), np.uint32(0),
                                           np.uint32(7), np.uint32(0), bufs["positions"], np.int32(0),
                                           bufs["out"]), (self.topk,), (self.topk,))
        return partial, final

    @staticmethod
    def _args(kernel, *args):
        kernel.set_args(*args)
        return kernel


def _buffers(cl, context, queue, logits: np.ndarray, history: np.ndarray, topk: int, groups: int) -> dict:
    mf = cl.mem_flags
    up = lambda a: cl.Buffer(context, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=a)   # noqa: E731
    return {"logits": up(logits), "history": up(history), "positions": up(np.zeros(1, np.int32)),
            "keys": cl.Buffer(context, mf.READ_WRITE, 8 * topk * groups),
            "max": cl.Buffer(context, mf.READ_WRITE, 4 * groups), "sum": cl.Buffer(context, mf.READ_WRITE, 4 * groups),
            "out": cl.Buffer(context, mf.READ_WRITE, 4)}


def _device(name: str):
    from perfx.runtime import Device
    return Device(name)


def compile_one(source: str, device: str, topk: int, groups: int) -> dict:
    """In this process (caches already empty): the CPU seconds of build, first partial launch, first final."""
    import pyopencl as cl
    dev = _device(device)
    context, queue = dev.context, cl.CommandQueue(dev.context)
    rng = np.random.default_rng(0)
    v = 49152
    bufs = _buffers(cl, context, queue, (rng.standard_normal(v) * 3).astype(np.float32),
                    rng.integers(0, v, 256).astype(np.int32), topk, groups)
    t0 = _cpu()
    program = Program(cl, context, source, topk, groups)
    t1 = _cpu()
    program.partial.set_args(np.int32(v), bufs["logits"], bufs["history"], np.int32(256), np.float32(1.3),
                             np.float32(1 / 0.7), bufs["keys"], bufs["max"], bufs["sum"])
    cl.enqueue_nd_range_kernel(queue, program.partial, (groups * topk,), (topk,)).wait()
    t2 = _cpu()
    program.final.set_args(np.int32(v), bufs["keys"], bufs["max"], bufs["sum"], np.float32(1 / 0.7), np.int32(0),
                           np.int32(40), np.float32(0.95), np.float32(0.05), np.uint32(1), np.uint32(0),
                           np.uint32(7), np.uint32(0), bufs["positions"], np.int32(0), bufs["out"])
    cl.enqueue_nd_range_kernel(queue, program.final, (topk,), (topk,)).wait()
    t3 = _cpu()
    return {"build": t1 - t0, "partial": t2 - t1, "final": t3 - t2}


def compile_main(args):
    rows = {}
    for _ in range(args.rounds):
        for device in args.devices:
            for topk in args.topk:
                for source in args.sources:
                    with tempfile.TemporaryDirectory() as cache:
                        env = dict(os.environ, XDG_CACHE_HOME=cache, POCL_CACHE_DIR=os.path.join(cache, "pocl"),
                                   PYOPENCL_CACHE_DIR=os.path.join(cache, "pyopencl"))
                        if device == "pocl" and args.pocl_icd:
                            env["OCL_ICD_VENDORS"] = args.pocl_icd
                        out = subprocess.run([sys.executable, __file__, "_one", source, device, str(topk),
                                              str(args.groups)], env=env, capture_output=True, text=True)
                        if out.returncode:
                            raise SystemExit(out.stderr)
                        got = json.loads(out.stdout.strip().splitlines()[-1])
                    rows.setdefault((device, topk, source), []).append(got)
                    print(device, topk, source, {k: round(x, 2) for k, x in got.items()}, flush=True)
    print(f"\nmedians of {args.rounds} rounds (CPU s): device TOPK source  build  sample_partial  sample_final")
    for (device, topk, source), got in rows.items():
        med = {k: statistics.median(g[k] for g in got) for k in got[0]}
        span = {k: (min(g[k] for g in got), max(g[k] for g in got)) for k in got[0]}
        print(f"{device:6s} {topk:4d} {source:28s} " + "  ".join(
            f"{med[k]:6.2f} ({span[k][0]:.2f}–{span[k][1]:.2f})" for k in ("build", "partial", "final")))


def time_main(args):
    import pyopencl as cl
    for device in args.devices:
        dev = _device(device)
        context = dev.context
        queue = cl.CommandQueue(context, properties=cl.command_queue_properties.PROFILING_ENABLE)
        programs = [Program(cl, context, s, args.topk[0], args.groups) for s in args.sources]
        rng = np.random.default_rng(1)
        for v in args.v:
            for inputs in ("normal", "lanes"):
                logits = (rng.standard_normal(v) * 3).astype(np.float32)
                if inputs == "lanes":
                    topk, chunk = args.topk[0], -(-v // args.groups)
                    lane = (np.arange(v) % chunk) % topk
                    share = lane < topk // 4
                    logits[share] += 20 + 2 * lane[share]
                history = rng.integers(0, v, 256).astype(np.int32)
                h, penalty = (256, 1.3) if inputs == "normal" else (0, 1.0)
                bufs = _buffers(cl, context, queue, logits, history, args.topk[0], args.groups)
                tokens, per_round = [], [{"partial": [], "final": []} for _ in programs]
                for _ in range(args.rounds):
                    for p, program in enumerate(programs):
                        for _ in range(3):
                            program.launch(cl, queue, bufs, v, h, penalty)[-1].wait()
                        samples = []
                        for _ in range(args.repeat):
                            events = program.launch(cl, queue, bufs, v, h, penalty)
                            events[-1].wait()
                            samples.append([(e.profile.end - e.profile.start) * 1e-9 for e in events])
                        for k, kernel in enumerate(("partial", "final")):
                            per_round[p][kernel].append(statistics.median(t[k] for t in samples))
                        out = np.empty(1, np.int32)
                        cl.enqueue_copy(queue, out, bufs["out"])
                        keys = np.empty(args.topk[0] * args.groups, np.uint64)
                        cl.enqueue_copy(queue, keys, bufs["keys"])
                        tokens.append((int(out[0]), keys.tobytes()))
                same = len(set(tokens)) == 1
                for kernel in ("partial", "final"):
                    first, last = per_round[0][kernel], per_round[-1][kernel]
                    ratios = [b / a for a, b in zip(first, last)]
                    print(f"{device:7s} v={v:6d} {inputs:6s} sample_{kernel:7s} " + "  ".join(
                        f"{os.path.basename(s)}: {1e6 * statistics.median(r[kernel]):7.1f} µs"
                        for s, r in zip(args.sources, per_round))
                        + f"  last/first {statistics.median(ratios):.3f} ({min(ratios):.3f}–{max(ratios):.3f})"
                        + f"  outputs identical: {same}  load {open('/proc/loadavg').read().split()[0]}", flush=True)


def main():
    if sys.argv[1] == "_one":
        source, device, topk, groups = sys.argv[2:6]
        print(json.dumps(compile_one(source, device, int(topk), int(groups))))
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=("compile", "time"))
    parser.add_argument("sources", nargs="+")
    parser.add_argument("--devices", nargs="+", default=["pocl", "intel"])
    parser.add_argument("--topk", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--v", type=int, nargs="+", default=[49152, 151936])
    parser.add_argument("--pocl-icd", help="compile: OCL_ICD_VENDORS for the PoCL processes (a PoCL of your own)")
    args = parser.parse_args()
    (compile_main if args.what == "compile" else time_main)(args)


if __name__ == "__main__":
    main()
