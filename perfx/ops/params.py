"""Each kernel family's parameters as data, and the one rule for parameters that do not fit.

A ``ParamSpace`` names the values a kernel's ``#define``s may take (the first of each list is the
default, and equals the ``#ifndef`` default in the ``.cl`` file), the rules a combination must keep on a
shape, the work-group size and local memory it needs, and what it asks of the device. A family whose kernel
comes in variants, one ``.cl`` file each with parameters of its own (gemv_q4: one kernel per weight
layout), is a ``Variants``: one parameter picks the variant, the others are that variant's ParamSpace's.

The rule, everywhere: parameters a caller passes explicitly and that do not fit the shape or device are
an error (``resolve`` raises, naming what does not fit); parameters looked up in a tuning database that
do not fit are skipped for the next candidate, with the reason kept (``perfx.tuning.database``).
Every parameter is an integer: the value handed to the compiler as ``-DNAME=value``.

A set is checked once on its way from the database to a launch: what passed the check travels as a
``Checked`` set (the database's choices, ``candidates``, ``resolve``), which ``resolve`` and ``check`` take as
it is for the shape it was checked for, or any part of that shape.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

from perfx.errors import PerfxError

Params = dict[str, Any]
Shape = dict[str, Any]

# Local memory a driver keeps of a work-group's for itself: NVIDIA's adds 4 bytes to every kernel that uses any,
# so a set sized to exactly the device's local memory builds and is then refused by the driver.
LOCAL_MEM_RESERVE = 64

# How every family encodes where int4 codes are read from (the READ define).
READ_BUFFER, READ_IMAGE2D, READ_IMAGE1D = 0, 1, 2
READ_NAMES = {READ_BUFFER: "buffer", READ_IMAGE2D: "image2d", READ_IMAGE1D: "image1d_buffer"}


@dataclass(frozen=True)
class Rule:
    """A condition a parameter set must keep on a shape; ``text`` says it when it does not."""

    text: str
    holds: Callable[[Params, Shape], bool]


@dataclass(frozen=True)
class Need:
    """What a parameter value asks of the device (e.g. READ=1 needs image support)."""

    text: str
    supported: Callable[[Any, Any], bool]   # (caps, value) -> bool


def needs_images(caps, value) -> bool:
    if value == READ_IMAGE2D:
        return caps.image_support
    if value == READ_IMAGE1D:
        return caps.image1d_buffer_texels > 0
    return True


READ_NEED = Need("image2d reads need image support, image1d_buffer views OpenCL 1.2 images", needs_images)
# The GPU-class variants: each behind the capability it uses, never assumed.
FP16_NEED = Need("fp16 arithmetic needs cl_khr_fp16", lambda caps, value: not value or caps.fp16)
# I8 2: int8 activations through the 4×8-bit dot products of cl_khr_integer_dot_product (I8 1 needs nothing)
INTEGER_DOT_NEED = Need("byte dot products (I8 2) need cl_khr_integer_dot_product",
                        lambda caps, value: value != 2 or caps.integer_dot_product)
# DOT 1: the int8-activation GEMMs' products through the same byte dot products
BYTE_DOT_NEED = Need("byte dot products (DOT 1) need cl_khr_integer_dot_product",
                     lambda caps, value: not value or caps.integer_dot_product)
SUBGROUPS_NEED = Need("subgroup operations need cl_khr_subgroups (or cl_intel_subgroups)",
                      lambda caps, value: not value or caps.subgroups)
# cl_qcom_reqd_sub_group_size: "half" and "full" waves, 64 and 128 work-items on Adreno 6xx–8xx.
QCOM_SUBGROUP_SIZES = (64, 128)


def required_subgroup_sizes(caps) -> tuple[int, ...]:
    """The sizes a kernel may require here (kernels/gpu.h REQD_SUBGROUP): Adreno's waves, or the sizes an
    Intel device lists; () where the device has no way to fix it."""
    if caps.reqd_subgroup_size == "qcom":
        return QCOM_SUBGROUP_SIZES
    if caps.reqd_subgroup_size == "intel":
        return caps.subgroup_sizes
    return ()


def _subgroup_size_supported(caps, value) -> bool:
    # A CPU runtime builds a subgroup of 32 or 64 as one SIMD32/64 body: a long compile of a GEMV (Intel's
    # CPU runtime, measured) and spilled registers to run it. Sizes up to 16 are its native widths.
    return not value or (value in required_subgroup_sizes(caps) and (caps.device_type != "CPU" or value <= 16))


SUBGROUP_SIZE_NEED = Need("a required subgroup size needs cl_qcom_reqd_sub_group_size or "
                          "cl_intel_required_subgroup_size with that size (at most 16 on a CPU)",
                          _subgroup_size_supported)


class Checked(dict):
    """A parameter set that passed ``ParamSpace.why_invalid`` for ``shape`` on a device of ``caps``.

    Made only where that check has just passed (``ParamSpace.check``, ``candidates``, the tuning database's
    look-up). ``check`` and ``resolve`` take it unchecked for that shape or any part of it: an optional shape
    key left out stands for its least demanding value (rules read those with ``shape.get``: no epilogue, no
    q/k norm), so a set that fits the whole shape fits the part.
    """

    def __init__(self, params: Params = (), space: ParamSpace | None = None, shape: Shape | None = None,
                 caps=None):
        # Without a space (a copy made from the items alone, as dataclasses.asdict makes) it holds for nothing.
        super().__init__(params)
        self.space, self.shape, self.caps = space, dict(shape or {}), caps

    def holds_for(self, space: ParamSpace, shape: Shape, caps) -> bool:
        """Whether this set was checked for ``space`` on ``shape`` (or more of it) on this device."""
        return (space is self.space and (caps is None or caps == self.caps)
                and all(key in self.shape and self.shape[key] == value for key, value in shape.items()))


class Checking:
    """``check`` and ``resolve`` of a parameter space (``ParamSpace``, ``Variants``): anything with ``family``,
    ``defaults``, ``why_invalid`` and ``candidates``."""

    def check(self, params: Params, shape: Shape, caps, what: str = "") -> Checked:
        """``params`` as a ``Checked`` set for this shape and device: as it is where it was checked for this
        shape already, else checked now; a PerfxError saying what does not fit (``what``: what it was to run,
        e.g. "the silu_mul epilogue")."""
        if isinstance(params, Checked) and params.holds_for(self, shape, caps):
            return params
        why = self.why_invalid(params, shape, caps)
        if why is not None:
            where = f"on {caps.name}" if caps is not None else ""
            target = "".join(f" {part}" for part in (what, where) if part)
            raise PerfxError(f"{self.family}: parameters {dict(params)} cannot run{target}: {why}")
        return Checked(params, self, shape, caps)



    def resolve(self, params: Params | None, shape: Shape, caps) -> Checked:
        """The defaults overridden by explicitly passed ``params``, checked (``check``) for this shape here.

        With ``params`` None (nothing asked for), defaults that do not fit this shape or device give way
        to the first parameter set that does: the generic fallback, never an error while one fits.
        """
        if params is None:
            defaults = self.defaults()
            why = self.why_invalid(defaults, shape, caps)
            if why is None:
                return Checked(defaults, self, shape, caps)
            fitting = self.candidates(shape, caps)
            if fitting:
                return fitting[0]
            raise PerfxError(f"{self.family}: no parameter set fits this shape on {caps.name} (the defaults: "
                             f"{why})")
        if not isinstance(params, Checked):
            params = {**self.defaults(params), **params}
        return self.check(params, shape, caps)


@dataclass(frozen=True)
class ParamSpace(Checking):
    family: str
    source: str                                   # kernel file in kernels/
    space: dict[str, tuple]                       # define -> allowed values; the first is the default
    rules: tuple[Rule, ...] = ()
    work_group_size: Callable[[Params, Shape], int] = lambda params, shape: 1
    local_memory: Callable[[Params, Shape], int] = lambda params, shape: 0
    needs: dict[str, Need] = field(default_factory=dict)

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.source,)

    def defaults(self, params: Params | None = None) -> Params:
        return {name: values[0] for name, values in self.space.items()}

    def why_invalid(self, params: Params, shape: Shape, caps=None) -> str | None:
        """None when the parameter set may run on this shape (and device, if given), else the reason."""
        unknown = sorted(set(params) - set(self.space))
        if unknown:
            return f"unknown parameter(s) {', '.join(unknown)} (known: {', '.join(self.space)})"
        missing = sorted(set(self.space) - set(params))
        if missing:
            return f"missing parameter(s) {', '.join(missing)}"
        for name, value in params.items():
            if value not in self.space[name]:
                return f"{name}={value!r} is not one of {list(self.space[name])}"
        for rule in self.rules:
            if not rule.holds(params, shape):
                return rule.text
        if caps is not None:
            wgs = self.work_group_size(params, shape)
            if wgs > caps.max_work_group:
                return f"work-group of {wgs} > the device's {caps.max_work_group}"
            local = self.local_memory(params, shape)
            if local > caps.local_mem - LOCAL_MEM_RESERVE:
                return (f"{local} bytes of local memory > the device's {caps.local_mem} less the "
                        f"{LOCAL_MEM_RESERVE} a driver may keep for itself")
            for name, need in self.needs.items():
                if not need.supported(caps, params[name]):
                    return f"{name}={params[name]}: {need.text}, which {caps.name} lacks"
        return None

    def candidates(self, shape: Shape, caps=None) -> list[Checked]:
        """Every parameter set allowed for this shape on this device: the tuner's search space."""
        names = list(self.space)
        sets = (dict(zip(names, values)) for values in itertools.product(*(self.space[n] for n in names)))
        return [Checked(params, self, shape, caps) for params in sets
                if self.why_invalid(params, shape, caps) is None]



@dataclass(frozen=True)
class Variants(Checking):
    """A family whose kernel comes in variants, each its own ``.cl`` file with its own parameters: ``key``, a
    parameter of every set, names the variant (the first is the default) and the others are that variant's
    ``ParamSpace``'s. The same interface as a ParamSpace: defaults, why_invalid, candidates, check, resolve."""

    family: str
    key: str
    variants: dict[int, ParamSpace]

    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(space.source for space in self.variants.values())

    @property
    def space(self) -> dict[str, tuple]:
        """Every parameter with every value any variant gives it (the tuner's neighbourhood walk; a set that
        mixes two variants' parameters is invalid and never runs)."""
        merged: dict[str, tuple] = {self.key: tuple(self.variants)}
        for space in self.variants.values():
            for name, values in space.space.items():
                merged[name] = merged.get(name, ()) + tuple(v for v in values if v not in merged.get(name, ()))
        return merged

    def variant(self, params: Params) -> ParamSpace:
        return self.variants[params[self.key]]

    def defaults(self, params: Params | None = None) -> Params:
        """The default variant's defaults, or those of the variant ``params`` names."""
        value = (params or {}).get(self.key, next(iter(self.variants)))
        return {self.key: value, **self.variants[value].defaults()} if value in self.variants else {self.key: value}

    def why_invalid(self, params: Params, shape: Shape, caps=None) -> str | None:
        value = params.get(self.key)
        if value not in self.variants:
            return f"{self.key}={value!r} is not one of {list(self.variants)}"
        return self.variants[value].why_invalid({k: v for k, v in params.items() if k != self.key}, shape, caps)

    def candidates(self, shape: Shape, caps=None) -> list[Checked]:
        return [Checked({self.key: value, **params}, self, shape, caps) for value, space in self.variants.items()
                for params in space.candidates(shape, caps)]
