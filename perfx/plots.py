"""Pictures of a tuning sweep (`perfx tune --plot DIR`): matplotlib, imported only when asked for."""

from __future__ import annotations

import re
from pathlib import Path

from perfx.errors import PerfxError


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PerfxError("--plot needs matplotlib, which is not installed: pip install \"perfx[plot]\" "
                         "(or pip install matplotlib)") from None
    matplotlib.use("Agg")  # files only: no display on a phone or in CI
    import matplotlib.pyplot as plt
    return plt


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")[:100]


def plot_parameters(result, path: Path, plt) -> None:
    """Time against each parameter of one problem: every verified candidate of the search a dot (grey: cut
    short), the confirmed contenders with error bars over the confirmation rounds (median, min to max),
    the parameters in force a red star."""
    timed = [o for o in result.outcomes if o.status in ("ok", "slow") and o.time_s]
    names = list(timed[0].params) if timed else []
    c = result.confirmation
    figure, axes = plt.subplots(1, max(len(names), 1), figsize=(3.2 * max(len(names), 1), 3.2), squeeze=False)
    for axis, name in zip(axes[0], names):
        values = sorted({str(o.params[name]) for o in timed} | {str(p[name]) for p in (c.contenders if c else [])},
                        key=lambda v: (len(v), v))
        xs = [values.index(str(o.params[name])) for o in timed]
        axis.scatter(xs, [o.time_s * 1e6 for o in timed],
                     c=["tab:blue" if o.status == "ok" else "tab:gray" for o in timed], s=14, alpha=0.6)
        if c is not None:
            for i, params in enumerate(c.contenders):
                column = [r[i] * 1e6 for r in c.rounds]
                median = c.median(params) * 1e6
                axis.errorbar([values.index(str(params[name])) + 0.15], [median], fmt="o", color="black", ms=3,
                              yerr=[[median - min(column)], [max(column) - median]], capsize=3)
        if result.chosen is not None and result.time_s:
            axis.scatter([values.index(str(result.chosen[name]))], [result.time_s * 1e6],
                         marker="*", s=160, c="tab:red", zorder=3)
        axis.set_xticks(range(len(values)), values)
        axis.set_yscale("log")
        axis.set_xlabel(name)
    axes[0][0].set_ylabel("time (µs)")
    rejected = sum(o.status not in ("ok", "slow") for o in result.outcomes)
    verdict = f"; confirmed over {len(c.rounds)} rounds (bars): {c.verdict}" if c else ""
    figure.suptitle(f"{result.family} {result.description}: {len(timed)} timed (grey: cut short), "
                    f"{rejected} rejected{verdict}", fontsize=8, wrap=True)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_ceilings(results, path: Path, copy_gbps: float, peak_gflops: float | None, plt,
                  read_gbps: float | None = None) -> None:
    """Achieved bandwidth of each problem's best against copy bandwidth (and the read-only stream where measured),
    and a roofline where flops count."""
    done = [r for r in results if r.time_s]
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, max(3.0, 0.28 * len(done) + 1.5)))
    labels = [f"{r.family} {r.description}" for r in done]
    left.barh(range(len(done)), [r.rate()[0] for r in done], color="tab:blue")
    left.axvline(copy_gbps, color="tab:red", linestyle="--", label=f"copy {copy_gbps:.1f} GB/s")
    if read_gbps:
        left.axvline(read_gbps, color="tab:orange", linestyle=":", label=f"read-only stream {read_gbps:.1f} GB/s")
    left.set_yticks(range(len(done)), labels, fontsize=6)
    left.invert_yaxis()
    left.set_xlabel("achieved GB/s (parameters in force)")
    left.legend(fontsize=7)
    points = [(r.flops / r.bytes_moved, r.rate()[1]) for r in done if r.flops]
    if points:
        intensities = [p[0] for p in points]
        low, high = min(intensities) / 2, max(intensities) * 2
        xs = [low * (high / low) ** (i / 50) for i in range(51)]
        roof = [x * copy_gbps if peak_gflops is None else min(peak_gflops, x * copy_gbps) for x in xs]
        right.plot(xs, roof, color="tab:red", label="roofline (copy bandwidth" +
                   (f", peak {peak_gflops:.0f} GFLOP/s)" if peak_gflops else ")"))
        right.scatter(intensities, [p[1] for p in points], c="tab:blue", s=14)
        right.set_xscale("log")
        right.set_yscale("log")
        right.legend(fontsize=7)
    right.set_xlabel("flops per byte moved")
    right.set_ylabel("achieved GFLOP/s")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_tuning_plots(results, directory, copy_gbps: float, peak_gflops: float | None = None,
                       read_gbps: float | None = None) -> list[Path]:
    """One PNG per problem (time against each parameter) and ceilings.png; returns the paths written."""
    plt = _pyplot()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for i, result in enumerate(results):
        path = directory / f"{i:03d}-{_slug(result.family + '-' + result.description)}.png"
        plot_parameters(result, path, plt)
        written.append(path)
    path = directory / "ceilings.png"
    plot_ceilings(results, path, copy_gbps, peak_gflops, plt, read_gbps)
    written.append(path)
    return written
