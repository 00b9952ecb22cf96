"""``ddpkit bench``'s figure: measured and predicted throughput against world size, with the ideal
line."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt  # noqa: E402

from ddpkit import _fs as fs  # noqa: E402


def plot_throughput(result: dict[str, Any], path: Path) -> None:
    scaling, pred = result["scaling"], result["predictions"]
    batch = scaling[1]["batch_size"]
    one = batch / scaling[1]["parts"]["step"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    sizes = sorted({*scaling, *(r["world_size"] for r in pred["larger"][pred["chosen"]]["rows"])})
    ax.plot(sizes, [n * one for n in sizes], color="0.6", linestyle=":", label="ideal (n x 1 rank)")
    for name, block in pred["larger"].items():
        rows = block["rows"]
        chosen = name == pred["chosen"]
        ax.plot(
            [r["world_size"] for r in rows],
            [r["samples_per_s"] for r in rows],
            marker="." if chosen else None,
            linewidth=2 if chosen else 1,
            alpha=1 if chosen else 0.5,
            label=f"predicted, {pred['intra_link']['name']} in a node, {name} between nodes",
        )
    here = pred["this_machine"]
    ax.plot(
        [1] + [r["world_size"] for r in here],
        [one] + [r["samples_per_s"] for r in here],
        "s--",
        color="tab:purple",
        markerfacecolor="none",
        label="predicted, this machine",
    )
    ax.plot(
        list(scaling),
        [n * batch / s["parts"]["step"] for n, s in scaling.items()],
        "o",
        color="black",
        label="measured, this machine",
    )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("world size (ranks)")
    ax.set_ylabel("throughput (samples/s)")
    cond = result["conditions"]
    ax.set_title(
        f"{result['workload']}: batch {batch}/rank ({cond['device']}, {cond['backend']})",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=110)
    plt.close(fig)
    fs.write_atomic(path, image.getvalue())
