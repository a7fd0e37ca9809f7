#!/usr/bin/env python3
"""Plots the JSON written by `kvr eval retrieval --json` (Debian python3-matplotlib).

    /usr/bin/python3 retrieval/eval/plot_retrieval_eval.py eval.json eval.png

One row of panels per (prompt, context): recall@k, attention mass, output relative error and
greedy agreement against the budget, one line per method.
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    rows = json.load(open(sys.argv[1]))["rows"]
    groups = sorted({(r["prompt"], r["context"]) for r in rows})
    metrics = [("recall", "recall@k vs exact"), ("mass", "attention mass covered"),
               ("rel_error", "relative error of output"), ("agreement", "greedy agreement")]
    fig, axes = plt.subplots(len(groups), len(metrics), figsize=(4 * len(metrics), 3.2 * len(groups)),
                             squeeze=False)
    for gi, (prompt, context) in enumerate(groups):
        sub = [r for r in rows if r["prompt"] == prompt and r["context"] == context]
        for mi, (key, title) in enumerate(metrics):
            ax = axes[gi][mi]
            # One line per (method, fetched-row format); the format shows only when there are
            # several (`--row-format`; JSON written before the option has none: "cache").
            lines = sorted({(r["method"], r.get("row_format", "cache")) for r in sub})
            several = len({f for _, f in lines}) > 1
            for method, fmt in lines:
                pts = sorted((r["budget"], r[key]) for r in sub
                             if r["method"] == method and r.get("row_format", "cache") == fmt)
                label = f"{method} ({fmt})" if several else method
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("budget (tokens per KV head)")
            ax.set_title(f"{title}\n{prompt}, context {context}", fontsize=9)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
