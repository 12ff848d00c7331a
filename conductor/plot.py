"""PNG figures of replays: TTFT CDF per run, and prefill and decode load over time.

matplotlib runs headless (Agg). Load curves are averaged over fixed time bins
so an hour of arrivals stays readable.
"""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from conductor.metrics import SERVED, Outcomes, RunSummary  # noqa: E402


def binned(t: list[float], y: list[float], bins: int = 120) -> tuple[np.ndarray, np.ndarray]:
    t, y = np.asarray(t), np.asarray(y)
    edges = np.linspace(t.min(), t.max() + 1e-9, bins + 1)
    which = np.clip(np.digitize(t, edges) - 1, 0, bins - 1)
    sums = np.bincount(which, weights=y, minlength=bins)
    counts = np.maximum(np.bincount(which, minlength=bins), 1)
    return (edges[:-1] + edges[1:]) / 2, sums / counts


def label(s: RunSummary) -> str:
    return f"{s.policy} / {s.admission}"


def plot_runs(runs: list[tuple[RunSummary, Outcomes]], path: str, title: str = "") -> None:
    """TTFT CDF, prefill queue over time and decode KV use over time for
    each run, side by side, written to ``path``. The two loads get their own
    axes: a queue of a few seconds next to a memory share near 100 % would
    hide the swings."""
    fig, (cdf, queue, memory) = plt.subplots(1, 3, figsize=(16, 4.8))
    for summary, out in runs:
        ttft = np.sort(out.ttft_s[(out.status == SERVED) & ~np.isnan(out.ttft_s)])
        if ttft.size:
            cdf.plot(ttft, np.arange(1, ttft.size + 1) / ttft.size, label=label(summary))
        queue.plot(*binned(out.load_time_s, out.prefill_load), label=label(summary))
        t, decode = binned(out.load_time_s, out.decode_load)
        memory.plot(t, 100 * decode, label=label(summary))
    cdf.set_xscale("symlog", linthresh=1.0)
    cdf.set_xlabel("TTFT (s)")
    cdf.set_ylabel("fraction of served requests")
    queue.set_ylabel("prefill queue, mean per instance (s)")
    memory.set_ylabel("decode KV use, mean per instance (%)")
    for ax in (queue, memory):
        ax.set_xlabel("simulated time (s)")
    for ax in (cdf, queue, memory):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
