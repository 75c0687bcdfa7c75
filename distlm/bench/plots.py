"""The scaling suite's PNG plots: tokens/s and efficiency against ranks, and the step-time split.

matplotlib (the ``bench`` extra) is imported here only, with the Agg backend: the plots
are files, and no display is needed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from distlm.bench.results import series_key, series_label
from distlm.errors import UsageError

PLOTS = ("tokens_per_s.png", "efficiency.png", "step_breakdown.png")


def require_matplotlib() -> None:
    """UsageError naming the extra when matplotlib is missing (checked before measuring)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("the plots need matplotlib: pip install 'distlm[bench]', or pass --no-plots") from None


def _pyplot():
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Rows by series, labelled by strategy, comm hook and tp degree (plus mode and batch when several
    series share one label)."""
    grouped: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        grouped.setdefault(series_key(row), []).append(row)
    names = [series_label(members[0]) for members in grouped.values()]
    labelled = {}
    for key, members in sorted(grouped.items(), key=lambda item: str(item[0])):
        first = members[0]
        label = series_label(first)
        if names.count(label) > 1:
            batch = first["batch_size"] if first["mode"] == "weak" else first["global_batch_size"]
            label += f" ({first['mode']}, batch {batch}, {first['precision']})"
        labelled[label] = sorted(members, key=lambda row: row["world_size"])
    return labelled


def write_plots(rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Write the three PNG files into ``out_dir``; returns their paths."""
    plt = _pyplot()
    series = _series(rows)
    ranks = sorted({row["world_size"] for row in rows})
    paths = [out_dir / name for name in PLOTS]

    figure, axes = plt.subplots(figsize=(6, 4.5))
    for index, (label, members) in enumerate(series.items()):
        color = f"C{index}"
        x = [row["world_size"] for row in members]
        axes.plot(x, [row["tokens_per_s"] for row in members], "o-", color=color, label=label)
        base = members[0]
        ideal = [base["tokens_per_s"] * n / base["world_size"] for n in x]
        axes.plot(x, ideal, ":", color=color, label=f"{label}, ideal")
    axes.set(xlabel="ranks", ylabel="tokens/s", title="Throughput", xticks=ranks)
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(paths[0], dpi=100)
    plt.close(figure)

    figure, axes = plt.subplots(figsize=(6, 4.5))
    for label, members in series.items():
        axes.plot([row["world_size"] for row in members], [row["efficiency"] for row in members], "o-", label=label)
    axes.axhline(1.0, color="grey", linestyle=":", label="ideal")
    top = max([1.0] + [row["efficiency"] for row in rows])
    axes.set(xlabel="ranks", ylabel="scaling efficiency", title="Efficiency against the smallest world size",
             xticks=ranks, ylim=(0, top * 1.1))
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(paths[1], dpi=100)
    plt.close(figure)

    bars = [(label, row) for label, members in series.items() for row in members]
    figure, axes = plt.subplots(figsize=(max(6, 0.9 * len(bars) + 2), 4.5))
    positions = list(range(len(bars)))
    bottom = [0.0] * len(bars)
    parts = (("compute_s", "compute"), ("comm_exposed_s", "exposed communication"), ("optimizer_s", "optimizer"))
    for index, (field, name) in enumerate(parts):
        # A slightly negative exposed communication (noise) is drawn as none.
        heights = [max(0.0, row[field]) for _, row in bars]
        axes.bar(positions, heights, bottom=bottom, color=f"C{index}", label=name)
        bottom = [b + h for b, h in zip(bottom, heights)]
    names = [f"{label}\n{row['world_size']} rank{'s' if row['world_size'] > 1 else ''}" for label, row in bars]
    axes.set_xticks(positions, names, fontsize="small")
    axes.set(ylabel="seconds per update", title="Where an update's time goes")
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(paths[2], dpi=100)
    plt.close(figure)
    return paths
