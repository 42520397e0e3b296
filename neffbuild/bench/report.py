"""The bench result as a text table and as a PNG plot (matplotlib, from the ``bench`` extra)."""

from __future__ import annotations

from pathlib import Path

from neffbuild.errors import InvalidInput

_COLORS = {"bucketed": "tab:blue", "fallback": "tab:red", "dynamic": "tab:green", "eager": "tab:gray"}


def table(result: dict) -> str:
    """Markdown table: one row per context; step medians, ratios, bytes and the bandwidth fraction."""
    variants = [v for v in ("bucketed", "fallback", "dynamic", "eager") if v in result["steps"]["rows"][0]]
    head = (["context", "bucket"] + [f"{v} ms (p90)" for v in variants]
            + ["fallback/bucketed time", "bytes ratio", "bucketed MB", "bound ms", "of bound"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in result["steps"]["rows"]:
        b = row["bytes"]
        cells = [str(row["context"]), str(row["ctx_bucket"])]
        cells += [f"{row[v]['median_ms']:.3f} ({row[v]['p90_ms']:.3f})" for v in variants]
        cells += [f"{row['fallback']['median_ms'] / row['bucketed']['median_ms']:.2f}x",
                  f"{b['fallback'] / b['bucketed']:.2f}x", f"{b['bucketed'] / 1e6:.2f}",
                  f"{row['bound_ms']:.3f}", f"{row['fraction_of_bound']:.1%}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(result: dict, path: str | Path, title: str) -> Path:
    """Step time (median, p90 as error bar) vs context for each variant, log-log."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise InvalidInput("--plot needs matplotlib: pip install 'neffbuild[bench]'") from exc
    rows = result["steps"]["rows"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [r["context"] for r in rows]
    for v, color in _COLORS.items():
        if v not in rows[0]:
            continue
        med = [r[v]["median_ms"] for r in rows]
        p90 = [r[v]["p90_ms"] - r[v]["median_ms"] for r in rows]
        ax.errorbar(xs, med, yerr=[[0] * len(med), p90], marker="o", capsize=3, color=color, label=v)
    ax.plot(xs, [r["bound_ms"] for r in rows], linestyle="--", color="black", label="bucketed bytes / copy bandwidth")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens needed)")
    ax.set_ylabel("decode step, ms (median; bar to p90)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
