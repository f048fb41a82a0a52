"""Instructions per weight of the decode GEMVs, and per product of the batched decode step's int8-activation
GEMMs, as Intel's CPU runtime compiles them: each parameter set is built, its x86 object taken from the program
binary (the ``.ocl.obj`` section of Intel's ELF) and disassembled, and the hot loop counted.

The hot loop is the innermost backward jump that loads scale pairs and holds the most vector instructions; one
trip covers one quantization group of every row a work-item owns (G · rows weights), times the unrolling, which
is read off the scale pairs the body loads (one half2 per row per group). So the count is static: what a group
costs in steady state, not the edges. Memory speed on this 2-core EPYC (~10 GB/s, ~16 G
int4 weights/s) at ~3 instructions a cycle per core needs well under 1 instruction per int4 weight.

The GEMMs (gemm_q4_i8, gemm_q8_i8, M = 4) apply each weight to the MT rows of X of a pass, so their figure is
per product (weight × row of X): their hot loop is the innermost loop with the most vector instructions (the
texels of a group, or the groups), one trip covering 32 weights (G for gemm_q8_i8) of each weight row a
work-item owns, times MT rows of X.

    python benchmarks/kernel_asm.py                    # defaults and shipped tuned sets, Intel's runtime
    python benchmarks/kernel_asm.py --show 'I8=1'       # and print the hot loop of the sets matching a filter
    python benchmarks/kernel_asm.py --families gemm_q4_i8 gemm_q8_i8 --vary DOT PAIR   # only these, each form

Needs ``objdump`` (binutils) and Intel's CPU runtime (``PERFX_DEVICE`` is ignored: this reads x86 code).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pyopencl as cl

from perfx.ops.gemm_q4 import GemmQ4
from perfx.ops.gemm_q8 import GemmQ8
from perfx.ops.gemv_q4 import GemvQ4
from perfx.ops.gemv_q8 import GemvQ8
from perfx.runtime import get_device
from perfx.tuning import SPECS

# (label, family, shape): the default model's decode GEMVs (SmolLM2-135M), a 7B one, and the int8 lm_head.
SHAPES = (
    ("qkv 960x576 G32", "gemv_q4", {"n": 960, "k": 576, "group": 32, "epilogue": "none", "bias": False}),
    ("gate-up 3072x576 G32", "gemv_q4", {"n": 3072, "k": 576, "group": 32, "epilogue": "silu_mul", "bias": False}),
    ("7B qkv 12288x4096 G128", "gemv_q4", {"n": 12288, "k": 4096, "group": 128, "epilogue": "none", "bias": False}),
    ("lm_head 49152x576 Q8 G32", "gemv_q8", {"n": 49152, "k": 576, "group": 32, "f32": False, "sym": True,
                                            "epilogue": "none", "bias": False}),
    ("M=4 gate-up 3072x576 G32", "gemm_q4_i8", {"m": 4, "n": 3072, "k": 576, "group": 32, "epilogue": "silu_mul"}),
    ("M=4 lm_head 49152x576 Q8 G32", "gemm_q8_i8", {"m": 4, "n": 49152, "k": 576, "group": 32, "f32": False,
                                                   "sym": True, "epilogue": "none"}),
)
GEMMS = ("gemm_q4_i8", "gemm_q8_i8")
SIMD = re.compile(r"^v")   # AVX instructions all start with v
SHIPPED = Path(__file__).resolve().parent.parent / "tuning" / "database"


def object_code(kernel: cl.Kernel) -> bytes:
    """The x86 relocatable object inside Intel's program binary (an ELF holding an ELF)."""
    binary = kernel.program.get_info(cl.program_info.BINARIES)[0]
    starts = [m.start() for m in re.finditer(b"\x7fELF", binary)]
    if len(starts) < 2:
        sys.exit("this runtime's program binary holds no x86 object (Intel's CPU runtime does)")
    return binary[starts[1]:]


def disassemble(obj: bytes) -> list[tuple[int, str, str]]:
    """(address, mnemonic, operands) of every instruction."""
    with tempfile.NamedTemporaryFile(suffix=".o") as f:
        f.write(obj)
        f.flush()
        text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", f.name], capture_output=True, text=True,
                              check=True).stdout
    out = []
    for line in text.splitlines():
        m = re.match(r"\s+([0-9a-f]+):\s+(\S+)\s*(.*)", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2), m.group(3)))
    return out


def innermost_loops(code_lines):
    """(first, last) line indices of each loop (a backward jump) with no other loop inside it."""
    index = {addr: i for i, (addr, _, _) in enumerate(code_lines)}
    loops = []
    for i, (addr, op, args) in enumerate(code_lines):
        target = re.match(r"([0-9a-f]+) <", args)
        if op.startswith("j") and target and int(target.group(1), 16) <= addr and int(target.group(1), 16) in index:
            loops.append((index[int(target.group(1), 16)], i))
    return [(a, b) for a, b in loops if not any(a < c and d < b for c, d in loops if (c, d) != (a, b))]


def hot_loop(code_lines):
    """The body of the innermost backward jump that loads scale pairs (the loop over groups, not the one that
    stages or quantizes x) with the most vector instructions."""
    innermost = [(a, b) for a, b in innermost_loops(code_lines) if scale_loads(code_lines[a:b + 1])]
    if not innermost:
        return []
    a, b = max(innermost, key=lambda ab: sum(1 for _, op, _ in code_lines[ab[0]:ab[1] + 1] if SIMD.match(op)))
    return code_lines[a:b + 1]


def count(device, family: str, shape: dict, params: dict):
    """The hot loop of ``params`` built as the model builds it, and the weights (products, for a GEMM) one trip
    covers."""
    rows = params["ROWS"] * (2 if shape["epilogue"].endswith("_mul") else 1)
    if family in GEMMS:
        if family == "gemm_q8_i8":
            kernel = GemmQ8(device, params, shape, "i8").kernel(shape["group"], shape["f32"], shape["sym"],
                                                                shape["epilogue"])
            weights = shape["group"]
        else:
            kernel = GemmQ4(device, i8_params=params, shape=shape, kind="i8").kernel("i8", shape["epilogue"],
                                                                                     params["READ"],
                                                                                     params["LAYOUT"])
            weights = 32
        loop = widest_loop(disassemble(object_code(kernel)))
        return loop, weights * rows * min(params["MT"], shape["m"])
    if family == "gemv_q8":
        kernel = GemvQ8(device, params, shape).kernel(shape["group"], bool(shape.get("f32")), bool(shape.get("sym")),
                                                    shape["epilogue"])
    else:
        kernel = GemvQ4(device, params, shape).kernel(shape["group"], shape["epilogue"], shape["k"])
    loop = hot_loop(disassemble(object_code(kernel)))
    weights = shape["group"] * rows * max(1, scale_loads(loop) // rows)
    return loop, weights


def widest_loop(code_lines):
    """The innermost loop (backward jump) with the most vector instructions."""
    innermost = innermost_loops(code_lines)
    a, b = max(innermost, key=lambda ab: sum(1 for _, op, _ in code_lines[ab[0]:ab[1] + 1] if SIMD.match(op)))
    return code_lines[a:b + 1]


def scale_loads(loop) -> int:
    """Half pairs read from memory and widened: a ``vcvtph2ps`` of memory, or of a register a 4-byte load just
    filled (the fp16 arithmetic variants widen registers too, which this leaves out)."""
    loaded, n = set(), 0
    for _, op, args in loop:
        operands = [a.strip() for a in re.split(r",(?![^(]*\))", args)]
        if op in ("vmovss", "vmovd") and "(" in operands[0]:
            loaded.add(operands[-1])
        elif op == "vcvtph2ps":
            if "(" in operands[0] or operands[0] in loaded:
                n += 1
            loaded.discard(operands[0])
    return n


def parameter_sets(device, family: str, shape: dict, every: bool) -> list[dict]:
    """The built-in defaults (of each layout's kernel), the shipped tuned sets for this shape, or every
    candidate."""
    spec = SPECS[family]
    if every:
        return list(spec.params.candidates(shape, device.caps))
    variants = getattr(spec.params, "variants", None)
    sets = [spec.params.defaults({spec.params.key: v}) for v in variants] if variants else [spec.params.defaults()]

    def untuned(params):
        """The set itself, or where it cannot run this shape, the first set of its variant that can: what runs
        untuned."""
        if spec.params.why_invalid(params, shape, device.caps) is None:
            return params
        return next(c for c in spec.params.candidates(shape, device.caps)
                    if not variants or c[spec.params.key] == params[spec.params.key])
    sets = [untuned(p) for p in sets]
    for path in sorted(SHIPPED.glob("intel-*.json")):
        for record in json.loads(path.read_text())["records"]:
            if record["family"] == family and all(record["shape"].get(k) == v for k, v in shape.items()):
                sets.append(record["params"])
    return sets


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--all", action="store_true", help="every candidate, not only the defaults and the shipped "
                                                           "tuned sets (the heuristic can miss a loop there)")
    parser.add_argument("--show", help="print the hot loop of the parameter sets whose text contains this "
                                       "(e.g. 'I8=1', 'LAYOUT=0')")
    parser.add_argument("--vary", nargs="+", metavar="NAME", default=(),
                        help="also each value of these parameters in every set counted (e.g. DOT PAIR)")
    parser.add_argument("--families", nargs="+", metavar="FAMILY", help="only these families (e.g. gemm_q4_i8)")
    args = parser.parse_args(argv)
    device = get_device("intel")
    print(f"{device.caps.name} / {device.caps.driver_version}: hot-loop instructions per weight\n")
    for label, family, shape in SHAPES:
        if args.families and family not in args.families:
            continue
        seen, rows = set(), []
        sets = parameter_sets(device, family, shape, args.all)
        for name in args.vary:
            values = SPECS[family].params.space.get(name, ())
            sets = [{**p, name: v} for p in sets for v in values]
        for params in sets:
            if SPECS[family].params.why_invalid({**SPECS[family].params.defaults(), **params}, shape, device.caps):
                continue
            text = " ".join(f"{k}={v}" for k, v in params.items())
            if text in seen:
                continue
            seen.add(text)
            loop, weights = count(device, family, shape, params)
            mix = collections.Counter(op for _, op, _ in loop)
            rows.append((len(loop) / weights, text, len(loop), weights, mix))
            if args.show and args.show in text:
                print(f"-- {label} {text}: {len(loop)} instructions, {weights} weights")
                for _, op, operands in loop:
                    print(f"     {op:12s} {operands}")
        print(f"{label} ({family}):")
        for per_weight, text, n, weights, mix in sorted(rows):
            top = ", ".join(f"{op} {c}" for op, c in mix.most_common(6))
            unit = "/product" if family in GEMMS else "/weight"
            print(f"  {per_weight:5.2f}{unit}  {n:4d} for {weights:5d}  {text}\n{'':18s}{top}")
        print()


if __name__ == "__main__":
    main()
