#!/usr/bin/env python3
"""Plots the JSON written by `kvr eval endpoint --json` (matplotlib; the venv of
scripts/python-env.sh has it).

    $(bash scripts/python-env.sh) tools/scripts/plot_eval_endpoint.py result.json eval.png

`kvr eval endpoint --png F.png` runs it. One row of two panels per prompt length: accuracy per
task, and agreement with full's answer per task, each a group of bars per (method, budget).
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def run_name(g):
    return g["method"] if g["method"] == "full" else f'{g["method"]} b{g["budget"]}'


def main():
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    with open(sys.argv[1]) as f:
        result = json.load(f)
    groups = result["groups"]
    lengths = sorted({g["length"] for g in groups})
    tasks = list(dict.fromkeys(g["task"] for g in groups))
    runs = list(dict.fromkeys(run_name(g) for g in groups))
    fig, axes = plt.subplots(len(lengths), 2, figsize=(max(8, 1.6 * len(tasks) * 2), 3.6 *
                                                       len(lengths)), squeeze=False)
    width = 0.8 / max(1, len(runs))
    for row, length in enumerate(lengths):
        for col, (key, title) in enumerate((("accuracy", "accuracy"),
                                            ("agreement_with_full", "agreement with full"))):
            ax = axes[row][col]
            for k, run in enumerate(runs):
                values = []
                for task in tasks:
                    match = [g for g in groups if g["task"] == task and g["length"] == length
                             and run_name(g) == run]
                    v = match[0][key] if match else None
                    values.append(v if v is not None else 0.0)
                xs = [i + (k - (len(runs) - 1) / 2) * width for i in range(len(tasks))]
                ax.bar(xs, values, width, label=run)
            ax.set_xticks(range(len(tasks)))
            ax.set_xticklabels(tasks, rotation=20, ha="right", fontsize=8)
            ax.set_ylim(0, 1.05)
            ax.set_title(f"{title}, {length} tokens")
            ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(runs), fontsize=8)
    config = result.get("config", {})
    fig.suptitle(f'kvr eval endpoint: {config.get("model", "")}, {config.get("samples", "?")} '
                 f'samples per task, seed {config.get("seed", "?")}', fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(sys.argv[2], dpi=100)
    return 0


if __name__ == "__main__":
    sys.exit(main())
