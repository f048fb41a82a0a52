"""A toy kernel family for the tuner's and database's tests: y = 2·x, with planted bad candidates.

MODE = "wrong" computes a wrong answer and MODE = "broken" does not compile, so the tests can check
that the tuner never chooses either. The kernel (tests/data/toy.cl) is built through pyopencl on the
device's context, since Device.build only reads kernels/; with ``through_device`` it is built by the device
(``Device.kernel`` of its path), and the spec names its programs (``Spec.programs``), so that the tuner builds
it ahead. ``calls`` counts runs and launches per
parameter set; ``interrupt_at`` raises KeyboardInterrupt at that run (a user's Ctrl-C mid-sweep), ``crash_at``
ends the process there at once (a driver that segfaults: nothing unwinds).
"""

from __future__ import annotations

import os

from pathlib import Path

import numpy as np
import pyopencl as cl

from perfx.ops.params import ParamSpace
from perfx.runtime import BuildError
from perfx.tuning.spec import Case, Spec
from perfx.tuning.tuner import Tuner

TOY_FILE = str(Path(__file__).parent / "data" / "toy.cl")
SOURCE = Path(TOY_FILE).read_text()
MODES = {"good": 0, "wrong": 1, "broken": 2}


def _defines(params) -> dict:
    return {"WGS": params["WGS"], "MODE": MODES[params["MODE"]]}


class Toy:
    def __init__(self, through_device: bool = False):
        self.through_device = through_device
        self.runs: dict[tuple, int] = {}
        self.launches: dict[tuple, int] = {}
        self.interrupt_at: int | None = None
        self.crash_at: int | None = None
        self.built: dict[tuple, cl.Kernel] = {}

    def kernel(self, device, params):
        key = tuple(sorted(params.items()))
        if self.through_device:
            return device.kernel(TOY_FILE, "toy_scale", _defines(params))
        if key not in self.built:
            defines = _defines(params)
            program = cl.Program(device.context, SOURCE)
            try:
                program.build(options=[f"-D{k}={v}" for k, v in defines.items()], devices=[device.cl_device])
            except cl.Error as e:
                raise BuildError("toy.cl", defines, str(e), device.caps.name) from e
            self.built[key] = cl.Kernel(program, "toy_scale")
        return self.built[key]

    def make_case(self, device, shape, rng) -> Case:
        n = shape["n"]
        x = device.upload(rng.standard_normal(n).astype(np.float32) + 0.5)
        y = device.poisoned(n, np.float32)

        def launch(params):
            key = tuple(sorted(params.items()))
            self.launches[key] = self.launches.get(key, 0) + 1
            wgs = params["WGS"]
            return [device.launch(self.kernel(device, params), (-(-n // wgs) * wgs,), (wgs,), np.int32(n),
                                  x.data, y.data)]

        def run(params):
            key = tuple(sorted(params.items()))
            self.runs[key] = self.runs.get(key, 0) + 1
            if self.interrupt_at is not None and sum(self.runs.values()) >= self.interrupt_at:
                raise KeyboardInterrupt
            if self.crash_at is not None and sum(self.runs.values()) >= self.crash_at:
                os._exit(139)
            y.fill(np.float32(np.nan))
            for event in launch(params):
                event.wait()
            return {"y": y.get()}

        return Case(expected={"y": 2.0 * x.get().astype(np.float64)}, run=run, launch=launch)

    def spec(self, space=None, family="toy") -> Spec:
        return Spec(
            params=ParamSpace(
                family=family,
                source="copy.cl",  # any file of kernels/: its hash pins the records; the toy's own is built here
                space=space or {"WGS": (16, 32, 64), "MODE": ("good", "wrong", "broken")},
                work_group_size=lambda p, s: p["WGS"],
            ),
            make_case=self.make_case,
            tolerance=1e-6,
            tolerance_why="y = 2·x is exact in fp32; the wrong mode is off by 1e-3",
            test_shapes=({"n": 1000},),
            bytes_moved=lambda s: 8 * s["n"],
            reference=lambda x: 2.0 * np.asarray(x, np.float64),
            fuzz_shapes=lambda st: st.fixed_dictionaries({"n": st.integers(1, 4000)}),
            oclgrind_shapes=({"n": 37},),
            flops=lambda s: s["n"],
            programs=(lambda device, shape, params: device.kernel(TOY_FILE, "toy_scale", _defines(params)))
            if self.through_device else None,
        )


def quiet_tuner(device, database, **kwargs) -> Tuner:
    """A Tuner whose reference kernel never drifts and that never pauses: these tests are about the search
    and its records; drift has tests of its own."""
    return Tuner(device, database, reference=lambda: 1e-3, cool_down_s=0, **kwargs)
