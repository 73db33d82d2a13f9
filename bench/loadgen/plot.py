"""TTFT and inter-token latency over the run, as a PNG (matplotlib, Agg backend).

Top: each request's time to first token at its start time (chats with a shared system prompt
and unique completions apart; hung-up requests hollow; errors as red crosses at the bottom).
Bottom: every gap between content chunks at the time the later chunk arrived.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .client import RequestResult

FLOOR_S = 1e-4  # a log axis cannot show 0 (two chunks read in one go)
COLORS = {"chat": "tab:blue", "completion": "tab:orange"}
LABELS = {"chat": "shared-prefix chat", "completion": "unique completion"}


def _ttft_panel(ax, results: Sequence[RequestResult]) -> None:
    for kind, color in COLORS.items():
        for outcome, face in (("ok", color), ("disconnected", "none")):
            rows = [r for r in results if r.kind == kind and r.outcome == outcome and r.chunk_s]
            if rows:
                label = LABELS[kind] + (" (hung up)" if outcome == "disconnected" else "")
                ax.scatter(
                    [r.start_s for r in rows],
                    [max(r.ttft_s, FLOOR_S) for r in rows],
                    s=14,
                    facecolors=face,
                    edgecolors=color,
                    label=label,
                )
    errors = [r for r in results if r.outcome == "error"]
    if errors:
        ax.scatter(
            [r.start_s for r in errors],
            [FLOOR_S] * len(errors),
            marker="x",
            color="tab:red",
            s=24,
            label="error (at its start)",
        )
    ax.set_yscale("log")
    ax.set_ylabel("time to first token (s)")
    ax.legend(fontsize=7, loc="upper right")
    ax.grid(alpha=0.3)


def _itl_panel(ax, results: Sequence[RequestResult]) -> None:
    for kind, color in COLORS.items():
        xs, ys = [], []
        for r in results:
            if r.kind != kind:
                continue
            for at, gap in zip(r.chunk_s[1:], r.itl_s, strict=True):
                xs.append(r.start_s + at)
                ys.append(max(gap, FLOOR_S))
        if xs:
            ax.scatter(xs, ys, s=3, alpha=0.4, color=color, label=LABELS[kind])
    ax.set_yscale("log")
    ax.set_xlabel("time since the run started (s)")
    ax.set_ylabel("gap between content chunks (s)")
    ax.legend(fontsize=7, loc="upper right", markerscale=3)
    ax.grid(alpha=0.3)


def plot_latencies(results: Sequence[RequestResult], path: Path, title: str) -> Path:
    """Write the two-panel scatter to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    try:
        _ttft_panel(top, results)
        _itl_panel(bottom, results)
        top.set_title(title, fontsize=9)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path
