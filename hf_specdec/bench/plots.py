"""PNG plots of a benchmark result (matplotlib, from the `bench` extra)."""

from __future__ import annotations

from pathlib import Path


def plot_all(result: dict, folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    summary = [r for r in result["summary"] if r["method"] != "plain"]
    datasets = list(dict.fromkeys(r["dataset"] for r in summary))
    methods = list(dict.fromkeys(r["method"] for r in summary))

    # speedup per method per dataset
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(datasets) * max(len(methods), 1) / 2), 4))
    width = 0.8 / max(len(methods), 1)
    for j, m in enumerate(methods):
        vals = [next((r["speedup_total"] for r in summary if r["method"] == m and r["dataset"] == d), 0)
                for d in datasets]
        ax.bar([i + j * width for i in range(len(datasets))], vals, width, label=m)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(datasets))], datasets)
    ax.set_ylabel("speedup vs plain generate()")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    paths.append(folder / "speedup.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    # acceptance-length histogram (hf_specdec methods: accepted drafts per verification step)
    fig, ax = plt.subplots(figsize=(6, 4))
    for m in methods:
        hist = {}
        for r in result["runs"]:
            if r["method"] == m and r.get("stats"):
                for k, v in r["stats"]["accept_histogram"].items():
                    hist[int(k) + 1] = hist.get(int(k) + 1, 0) + v
        if hist:
            total = sum(hist.values())
            xs = sorted(hist)
            ax.plot(xs, [hist[x] / total for x in xs], marker="o", label=m)
    ax.set_xlabel("tokens committed per target forward")
    ax.set_ylabel("share of steps")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(folder / "acceptance_hist.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    # forward-cost curve
    curve = {int(k): v for k, v in result["cost_curve_ms"].items()}
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = sorted(curve)
    ax.plot(xs, [curve[x] for x in xs], marker="o")
    ax.set_xlabel("new tokens per forward (q)")
    ax.set_ylabel("ms per target forward")
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    paths.append(folder / "forward_cost.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths
