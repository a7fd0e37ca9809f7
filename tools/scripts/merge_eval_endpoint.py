#!/usr/bin/env python3
"""Merges the JSONs of several `kvr eval endpoint --json` runs that differ only in --seed and
--samples into one, and prints each method's difference from full per task and length:

    merge_eval_endpoint.py seed1.json seed2.json merged.json

Runs are split by seed so that a long evaluation keeps what finished if a later run does not.
Every answer keeps its run's seed ("seed" in each sample); the groups are recomputed from the
answers as the tool computes them (accuracy: mean score, a failed request scoring 0; agreement:
over the samples whose full answer is known; TTFT and prompt tokens: over the completed ones;
tok/s: (output tokens - 1) / (latency - TTFT) summed). The merged config has the seeds as a
list and the samples per task and length summed.

The comparison (stdout) pairs each method's sample with full's on the same prompt: `lower`
and `higher` count the samples where the method scored below / above full, and `p` is the
two-sided sign test on them (exact binomial, ties left out): the chance of a split at least as
uneven if the method were as good as full. Standard library only."""
import json
import math
import sys

# Settings that must agree for the answers of two runs to be pooled.
SAME = ("model", "tasks", "methods", "budgets", "lengths", "context", "temperature", "n_sink",
        "local_window", "backend", "tokenizer", "corpus_files")


def merge(results):
    """One result dict from several; ValueError naming the setting where they differ."""
    if not results:
        raise ValueError("no results to merge")
    first = results[0]["config"]
    seeds = []
    samples = []
    for r in results:
        c = r["config"]
        for key in SAME:
            if c.get(key) != first.get(key):
                raise ValueError(f"config.{key} differs: {c.get(key)!r} vs {first.get(key)!r}")
        if c["seed"] in seeds:
            raise ValueError(f"config.seed {c['seed']} given twice")
        seeds.append(c["seed"])
        for s in r["samples"]:
            samples.append(dict(s, seed=c["seed"]))
    config = dict(first)
    config["seed"] = seeds
    config["samples"] = sum(r["config"]["samples"] for r in results)
    return {"config": config, "groups": aggregate(samples), "samples": samples}


def aggregate(samples):
    """The groups of (task, length, method, budget), in order of first appearance."""
    order, acc = [], {}
    for s in samples:
        key = (s["task"], s["length"], s["method"], s["budget"])
        if key not in acc:
            order.append(key)
            acc[key] = {"n": 0, "failed": 0, "score": 0.0, "agree": 0, "compared": 0,
                        "completed": 0, "ttft": 0.0, "prompt": 0.0, "dec_tok": 0.0,
                        "dec_ms": 0.0}
        a = acc[key]
        a["n"] += 1
        a["score"] += s["score"]
        if s["agrees_with_full"] is not None:
            a["compared"] += 1
            a["agree"] += 1 if s["agrees_with_full"] else 0
        if not s["success"]:
            a["failed"] += 1
            continue
        a["completed"] += 1
        a["ttft"] += s["ttft_ms"]
        a["prompt"] += s["prompt_tokens"]
        if s["output_tokens"] > 1 and s["latency_ms"] > s["ttft_ms"]:
            a["dec_tok"] += s["output_tokens"] - 1
            a["dec_ms"] += s["latency_ms"] - s["ttft_ms"]
    groups = []
    for key in order:
        a = acc[key]
        done = a["completed"]
        groups.append({
            "task": key[0], "length": key[1], "method": key[2], "budget": key[3],
            "samples": a["n"], "failed": a["failed"], "accuracy": a["score"] / a["n"],
            "agreement_with_full": a["agree"] / a["compared"] if a["compared"] else None,
            "output_tokens_per_s": 1000 * a["dec_tok"] / a["dec_ms"] if a["dec_ms"] > 0 else 0,
            "mean_ttft_ms": a["ttft"] / done if done else 0,
            "mean_prompt_tokens": a["prompt"] / done if done else 0,
        })
    return groups


def sign_test(lower, higher):
    """Two-sided exact sign test p-value of a lower/higher split (ties left out)."""
    n = lower + higher
    if n == 0:
        return 1.0
    k = min(lower, higher)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def compare(result):
    """Rows (task, length, method, budget, n, accuracy, full's, points, agreement, lower,
    higher, p) for every method but full."""
    full = {}
    for s in result["samples"]:
        if s["method"] == "full":
            full[(s.get("seed"), s["task"], s["length"], s["index"])] = s["score"]
    cells = {}
    for s in result["samples"]:
        if s["method"] == "full":
            continue
        ref = full.get((s.get("seed"), s["task"], s["length"], s["index"]))
        if ref is None:
            continue
        c = cells.setdefault((s["task"], s["length"], s["method"], s["budget"]),
                             {"n": 0, "score": 0.0, "ref": 0.0, "lower": 0, "higher": 0})
        c["n"] += 1
        c["score"] += s["score"]
        c["ref"] += ref
        c["lower"] += 1 if s["score"] < ref else 0
        c["higher"] += 1 if s["score"] > ref else 0
    agreement = {(g["task"], g["length"], g["method"], g["budget"]): g["agreement_with_full"]
                 for g in result["groups"]}
    rows = []
    for key, c in cells.items():
        rows.append(key + (c["n"], c["score"] / c["n"], c["ref"] / c["n"],
                           100 * (c["score"] - c["ref"]) / c["n"], agreement.get(key),
                           c["lower"], c["higher"], sign_test(c["lower"], c["higher"])))
    return rows


def main(argv):
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    results = []
    for path in argv[:-1]:
        with open(path) as f:
            results.append(json.load(f))
    try:
        merged = merge(results)
    except ValueError as e:
        print(f"merge_eval_endpoint: {e}", file=sys.stderr)
        return 2
    with open(argv[-1], "w") as f:
        json.dump(merged, f, indent=1)
    print(f"{len(merged['samples'])} answers, seeds {merged['config']['seed']}, "
          f"{merged['config']['samples']} samples per task and length -> {argv[-1]}")
    print(f"{'task':<18} {'length':>6} {'method':<10} {'n':>3} {'acc':>6} {'full':>6} "
          f"{'points':>7} {'agree':>6} {'lower':>5} {'higher':>6} {'p':>6}")
    for (task, length, method, budget, n, acc, ref, points, agree, lower, higher,
         p) in compare(merged):
        agree_text = f"{agree:.2f}" if agree is not None else "-"
        print(f"{task:<18} {length:>6} {method:<10} {n:>3} {acc:>6.3f} {ref:>6.3f} "
              f"{points:>+7.1f} {agree_text:>6} {lower:>5} {higher:>6} {p:>6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
