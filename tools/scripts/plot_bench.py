#!/usr/bin/env python3
"""Plots the JSON written by `kvr bench --result-file` (Debian python3-matplotlib).

    /usr/bin/python3 tools/scripts/plot_bench.py result.json latency.png

`kvr bench --plot F.png` runs it. Four panels: the CDFs of TTFT, TPOT and ITL (median and p99
marked), and each request's end-to-end latency against the time it was sent (failed requests
as red crosses), which shows queueing building up under load.
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
from percentile import percentile  # noqa: E402


def cdf(ax, values_ms, title):
    values = sorted(values_ms)
    if values:
        n = len(values)
        ax.plot(values, [(i + 1) / n for i in range(n)], drawstyle="steps-post")
        for p, style in ((50, "--"), (99, ":")):
            v = percentile(values, p)
            ax.axvline(v, linestyle=style, color="gray", label=f"p{p} {v:.1f} ms")
        ax.legend(loc="lower right", fontsize=8)
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of requests" if "ITL" not in title else "fraction of gaps")
    ax.grid(alpha=0.3)


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    r = json.load(open(sys.argv[1]))
    ok = [e == "" for e in r["errors"]]
    ttfts = [t * 1e3 for t, good in zip(r["ttfts"], ok) if good]
    tpots = [(lat - t) * 1e3 / (n - 1)
             for lat, t, n, good in zip(r["latencies"], r["ttfts"], r["output_lens"], ok)
             if good and n > 1]
    itls = [g * 1e3 for gaps, good in zip(r["itls"], ok) if good for g in gaps]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    cdf(axes[0][0], ttfts, "TTFT")
    cdf(axes[0][1], tpots, "TPOT (excl. first token)")
    cdf(axes[1][0], itls, "ITL")
    ax = axes[1][1]
    starts = r.get("start_times") or list(range(len(ok)))
    ax.scatter([s for s, good in zip(starts, ok) if good],
               [lat * 1e3 for lat, good in zip(r["latencies"], ok) if good], s=8, label="completed")
    failed = [s for s, good in zip(starts, ok) if not good]
    if failed:
        ax.scatter(failed, [0] * len(failed), marker="x", color="red", label="failed")
    ax.set_title("End-to-end latency by send time")
    ax.set_xlabel("send time (s)")
    ax.set_ylabel("ms")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    rate = r.get("request_rate")
    conc = r.get("max_concurrency")
    fig.suptitle(f"kvr bench: {r.get('model_id')}, {r.get('completed')} completed / "
                 f"{r.get('failed', 0)} failed, rate {rate}, concurrency {conc}, "
                 f"{r.get('request_throughput', 0):.2f} req/s, "
                 f"{r.get('output_throughput', 0):.1f} tok/s")
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=100)
    return 0


if __name__ == "__main__":
    sys.exit(main())
