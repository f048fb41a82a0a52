"""A Python model of the int4 GEMVs' index arithmetic at a GPU's limits (issue 41), so that days without a GPU
still keep the GPU's shape: for a parameter set, a shape (N, K, group) and a GPU preset, the work-groups a
launch makes and how many that is a compute unit, and, for each load instruction of the codes that a warp/wave
issues, the bytes its work-items read: the fraction of each 32-byte sector they touch that they use.

Two kernels are modelled, each from its ``.cl`` file's index arithmetic, written again here:
- ``kernels/gemv_q4_split.cl``: ``split_figures``;
- ``kernels/gemv_q4_rows.cl`` (gemv_q4's rows layout): ``rows_figures``, printed for the notes, not asserted.

A load instruction: one (pass, row of the work-item, texel of the group) of the kernel's loop, issued by every
work-item of a warp at once. A warp is ``wave`` consecutive local ids of a work-group (the whole work-group
where it is narrower). Each pass after the first starts where the first did, LANES (or LANES groups) further,
so the first and the last pass of a slice stand for all of them; the first and the last row block, at the first
and the last slice, stand for the launch (the last ones clamp rows and end slices early).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from perfx.ops.gemv_q4_split import PARAMS as SPLIT_PARAMS, slice_texels, slices as split_slices
from perfx.ops.gemv_q4 import ROWS_LAYOUT
from perfx.tuning.gemv_q4_split import SPEC
from perfx.tuning.problems import problems_for

SECTOR = 32   # bytes: the unit an NVIDIA L2/DRAM transaction moves (and an Adreno's cache line holds two)
TEXEL = 16    # bytes of codes a texel


@dataclass(frozen=True)
class GpuPreset:
    """What the model needs of a GPU: compute units, warp/wave widths, and the limits a parameter set must fit
    (with the capabilities its parameters' Needs read)."""

    name: str
    compute_units: int
    waves: tuple[int, ...]
    max_work_group: int
    local_mem: int
    fp16: bool = False
    subgroups: bool = False
    reqd_subgroup_size: str = ""
    source: str = ""

    @property
    def caps(self):
        """A capabilities-like object for ``ParamSpace.candidates`` at this GPU's limits."""
        return SimpleNamespace(
            name=self.name, max_work_group=self.max_work_group, local_mem=self.local_mem, fp16=self.fp16,
            subgroups=self.subgroups, integer_dot_product=False, reqd_subgroup_size=self.reqd_subgroup_size,
            subgroup_sizes=(), device_type="GPU", image_support=True, image1d_buffer_texels=1 << 27)


GPU_PRESETS = (
    GpuPreset("h200", 132, (32,), 1024, 48 << 10, source="measured through NVIDIA's OpenCL (benchmarks/NOTES.md)"),
    # perfx.runtime.capabilities.LIMIT_PRESETS give the Adreno limits (work-group 1024, 32 KiB local memory);
    # they carry no compute units. Adreno 740 (Snapdragon 8 Gen 2, and the QCS8550 of the "adreno-qcs" preset)
    # has 6 shader processors, which its OpenCL driver reports as compute units; the 12 stands for the larger
    # Adreno 8xx parts. Waves: "half" 64 and "full" 128 work-items.
    GpuPreset("adreno740", 6, (64, 128), 1024, 32 << 10, True, True, "qcom",
              "LIMIT_PRESETS['adreno740'], 6 shader processors"),
    GpuPreset("adreno-qcs", 6, (64, 128), 1024, 32 << 10, True, True, "qcom",
              "LIMIT_PRESETS['adreno-qcs'] (QCS8550: Adreno 740), 6 shader processors"),
    GpuPreset("adreno-12cu", 12, (64, 128), 1024, 32 << 10, True, True, "qcom", "a larger Adreno 8xx, 12"),
)


# The default model, Llama-2-7B, and a 1B–4B family's (Qwen3-1.7B): perfx's synthetic presets of them.
MODELS = ("smollm2-135m", "llama-2-7b", "qwen3-1.7b")


def model_shapes(model: str) -> dict[str, dict]:
    """The int4 decode GEMVs of a synthetic model preset (``perfx.sources.synthetic``), by role, as `perfx tune
    --model synthetic:<model>` measures them (its int4 group included): the step's own shapes
    (``perfx.tuning.problems``), never a second list."""
    problems, _ = problems_for(f"synthetic:{model}", {"gemv_q4_split": SPEC}, max_m=1)
    return {p.label: p.shape for p in problems}


def sector_use(addresses: list[int]) -> float:
    """The fraction of the 32-byte sectors a load instruction touches that its work-items use: the byte address
    of each active work-item's 16-byte texel (16-byte aligned); a texel read twice (rows clamped at the end)
    counts once."""
    texels = set(a // TEXEL for a in addresses)
    if not texels:
        return 1.0
    return len(texels) * TEXEL / (SECTOR * len({a * TEXEL // SECTOR for a in texels}))


def _warps(work_group: int, wave: int) -> list[range]:
    return [range(start, min(start + wave, work_group)) for start in range(0, work_group, wave)]


def split_launch(params, shape) -> tuple[int, int, int]:
    """(row blocks, slices, work-group size) of gemv_q4_split's product launch (``GemvQ4Split.launch_shape``)."""
    rows, sets = params["ROWS"], params["WGR"]
    blocks = -(-(-(-shape["n"] // rows)) // sets)
    return blocks, split_slices(shape["k"], params["SPLIT"]), params["LANES"] * sets


def split_figures(params, shape, preset: GpuPreset) -> dict:
    """gemv_q4_split at ``shape`` on ``preset``: work-groups, work-groups a compute unit, the least sector use
    of any modelled load instruction of the codes (over every wave width of the preset)."""
    n, texels = shape["n"], shape["k"] // 32
    lanes, rows, sets, split = params["LANES"], params["ROWS"], params["WGR"], params["SPLIT"]
    blocks, slices, work_group = split_launch(params, shape)
    ts = slice_texels(shape["k"], split)
    worst = 1.0
    for wave in preset.waves:
        for block in {0, blocks - 1}:
            for s in {0, slices - 1}:
                t0, t1 = s * ts, min(s * ts + ts, texels)
                passes = max(1, -(-(t1 - t0) // lanes))
                for p in {0, passes - 1}:
                    for warp in _warps(work_group, wave):
                        for r in range(rows):
                            loads = []
                            for lid in warp:
                                lane, row_set = lid % lanes, lid // lanes
                                t = t0 + lane + lanes * p
                                if t >= t1:
                                    continue   # past the slice: the work-item is idle at this pass
                                row = min((block * sets + row_set) * rows + r, n - 1)
                                loads.append((row * texels + t) * TEXEL)
                            worst = min(worst, sector_use(loads))
    groups = blocks * slices
    return {"work_groups": groups, "per_cu": groups / preset.compute_units, "sector_use": worst,
            "work_group": work_group}


def rows_figures(params, shape, preset: GpuPreset) -> dict:
    """gemv_q4's rows kernel (kernels/gemv_q4_rows.cl) the same way: lane l of a row set reads group
    l + LANES·i, its TEXELS_PER_GROUP texels one load each; rows own_rows(first = global id / LANES · ROWS)."""
    n, k, group = shape["n"], shape["k"], shape["group"]
    texels, per_group, groups_k = k // 32, group // 32, k // group
    lanes, rows, sets = params["LANES"], params["ROWS"], params["WGR"]
    rows_all = 2 * rows if shape.get("epilogue", "none") != "none" else rows   # gate-up: gate and up rows
    outputs = n // 2 if rows_all > rows else n
    work_group = lanes * sets
    blocks = -(-(-(-outputs // rows)) // sets)
    passes = max(1, -(-groups_k // lanes))
    worst = 1.0
    for wave in preset.waves:
        for block in {0, blocks - 1}:
            for p in {0, passes - 1}:
                for warp in _warps(work_group, wave):
                    for r in range(rows_all):
                        for j in range(per_group):
                            loads = []
                            for lid in warp:
                                lane, row_set = lid % lanes, lid // lanes
                                g = lane + lanes * p
                                if g >= groups_k:
                                    continue
                                o = min((block * sets + row_set) * rows + r % rows, outputs - 1)
                                row = o + (outputs if r >= rows else 0)
                                loads.append((row * texels + g * per_group + j) * TEXEL)
                            worst = min(worst, sector_use(loads))
    return {"work_groups": blocks, "per_cu": blocks / preset.compute_units, "sector_use": worst,
            "work_group": work_group}


def split_sets(shape, preset: GpuPreset) -> list[dict]:
    """Every gemv_q4_split set the tuner may choose for ``shape`` at the preset's limits."""
    return SPLIT_PARAMS.candidates(shape, preset.caps)


def rows_sets(shape, preset: GpuPreset) -> list[dict]:
    """gemv_q4's rows-layout sets at the preset's limits, one per (LANES, ROWS, WGR): the codes' loads do not
    depend on the other parameters (reads through a buffer, fp32 or fp16, x as floats or int8)."""
    seen = {}
    for p in ROWS_LAYOUT.candidates(shape, preset.caps):
        seen.setdefault((p["LANES"], p["ROWS"], p["WGR"]), p)
    return list(seen.values())


def best(figures: list[tuple[dict, dict]]) -> tuple[dict, dict]:
    """The set the model would pick for a GPU, of (params, figures): whole sectors first, then at least 4
    work-groups a compute unit, then the largest work-group (the most loads in flight a group), the most rows
    a work-item (x reused), the fewest slices (the least partial-sum traffic). The tuner decides; this is for
    the notes."""
    return max(figures, key=lambda pf: (pf[1]["sector_use"] >= 1.0, pf[1]["per_cu"] >= 4, pf[1]["work_group"],
                                        pf[0]["ROWS"], -pf[0].get("SPLIT", 1), pf[1]["per_cu"]))


def table(kernel: str = "split", models=MODELS, presets=GPU_PRESETS) -> str:
    """The figures as a Markdown table: per model, role and preset, the range of work-groups a compute unit and
    the least sector use over every allowed set, and the best set's figures."""
    figures_of = split_figures if kernel == "split" else rows_figures
    sets_of = split_sets if kernel == "split" else rows_sets
    lines = ["| model | role | shape | GPU | sets | WG/CU range | least sector use | sets ≥ 4 WG/CU | best set | "
             "its WG/CU | its sector use |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for model in models:
        for role, shape in model_shapes(model).items():
            for preset in presets:
                figs = [(p, figures_of(p, shape, preset)) for p in sets_of(shape, preset)]
                per_cu = [f["per_cu"] for _, f in figs]
                params, fig = best(figs)
                keys = ("SPLIT", "LANES", "ROWS", "WGR")
                name = " ".join(f"{k[0] if k != 'WGR' else 'W'}{params[k]}" for k in keys if k in params)
                lines.append(f"| {model} | {role} | {shape['n']}×{shape['k']} | {preset.name} | {len(figs)} | "
                             f"{min(per_cu):.1f}–{max(per_cu):.1f} | {min(f['sector_use'] for _, f in figs):.2f} | "
                             f"{sum(f['per_cu'] >= 4 for _, f in figs)} | {name} | {fig['per_cu']:.1f} | "
                             f"{fig['sector_use']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys
    print(table(sys.argv[1] if len(sys.argv) > 1 else "split"))
