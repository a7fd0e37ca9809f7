#!/usr/bin/env python3
"""`kvr eval endpoint` against a real `kvr up` cluster (SmolLM2 on the CPU), run under the
checked-in quality gate (tools/eval/gate/*.json: its settings, e.g. every task at 768 tokens,
2 samples each, methods full, exact and streaming, sink 16, window 128, budget 64):

  * the run passes the gate (exit 0, "gate: pass");
  * its JSON holds every task for every method, full's agreement with itself is 1, every
    accuracy and agreement is in [0, 1], no request failed, the server counted each prompt
    within the length, and full answered the pass key of niah_single at least once;
  * the PNG is written;
  * the needle task's samples sent again through the OpenAI-compatible HTTP API
    (--backend openai-completions) get the same answers from full and exact as over gRPC;
  * the same result with exact's answers doctored to a broken method's (accuracy 0 on every
    task, as a method selecting random rows would score) fails the gate on each rule it breaks:
    more than the gate's exact_margin under full, more than its tolerance under its record,
    below streaming when streaming's record is above 0 (exit 2); with streaming doctored to
    100%, every other method is below it and fails.

Usage: eval_endpoint_test.py --kvr build/tools/kvr --gate tools/eval/gate/F.json
(KVR_TEST_MODEL: the GGUF; exit 77 when it is missing). Python standard library only; the
PNG is drawn by the venv of scripts/python-env.sh (KVR_TEST_PYTHON).
"""

import json
import os
import subprocess
import sys
import tempfile
import time

from kvr_up import SKIP, Checks, Cluster, parse_args


def main():
    args = parse_args("--gate")
    if args is None:
        return SKIP
    with open(args.gate) as f:
        gate = json.load(f)
    run = gate["run"]

    check = Checks()

    with tempfile.TemporaryDirectory(prefix="kvr-eval-endpoint-") as tmp:
        result_path = os.path.join(tmp, "eval.json")
        png_path = os.path.join(tmp, "eval.png")
        cluster = Cluster(args.kvr, os.path.join(tmp, "logs"),
                          ["--store-capacity", "512MiB", "--decode-arg=--batch-slots=32"],
                          ready_timeout=120)
        try:
            up = time.time()
            r = subprocess.run([args.kvr, "eval", "endpoint", "--target", cluster.grpc,
                                *cluster.grpc_args, "--gate", args.gate, "--concurrency", "2",
                                "--json", result_path, "--png", png_path],
                               capture_output=True, text=True, timeout=600)
            print(r.stdout)
            print(r.stderr, file=sys.stderr)
            print(f"      kvr eval endpoint took {time.time() - up:.1f} s")
            # The same samples of one task through the OpenAI-compatible HTTP API: greedy
            # answers, so they must be the gRPC run's.
            http_path = os.path.join(tmp, "http.json")
            h = subprocess.run([args.kvr, "eval", "endpoint", "--backend", "openai-completions",
                                "--base-url", cluster.base_url, *cluster.grpc_args,
                                "--tasks", "niah_single",
                                "--methods", "full,exact", "--budgets", str(run["budget"]),
                                "--lengths", str(run["length"]), "--samples", str(run["samples"]),
                                "--seed", str(run["seed"]), "--sink", str(run["n_sink"]),
                                "--local", str(run["local_window"]), "--json", http_path],
                               capture_output=True, text=True, timeout=600)
            print(h.stdout)
            print(h.stderr, file=sys.stderr)
        finally:
            cluster.stop()
        check(r.returncode == 0 and "gate: pass" in r.stdout,
              f"the run passes the gate (exit {r.returncode})")
        check(os.path.exists(result_path), "the JSON is written")
        if not os.path.exists(result_path):
            return 1
        with open(result_path) as f:
            result = json.load(f)
        check(os.path.exists(png_path) and open(png_path, "rb").read(8) == b"\x89PNG\r\n\x1a\n",
              "the PNG is written")

        groups = result["groups"]
        methods = run["methods"]
        seen = {(g["task"], g["method"]) for g in groups}
        check(all((t, m) in seen for t in run["tasks"] for m in methods),
              f"every task for every method ({len(seen)} groups)")
        check(all(g["failed"] == 0 for g in groups), "no request failed")
        full = [g for g in groups if g["method"] == "full"]
        check(all(g["agreement_with_full"] == 1 for g in full), "full agrees with itself")
        check(all(0 <= g["accuracy"] <= 1 and
                  (g["agreement_with_full"] is None or 0 <= g["agreement_with_full"] <= 1)
                  for g in groups), "accuracies and agreements are in [0, 1]")
        check(all(0 < s["prompt_tokens"] <= run["length"] for s in result["samples"]),
              f"the server counted every prompt within {run['length']} tokens")
        passkeys = [s for s in result["samples"]
                    if s["task"] == "niah_single" and s["method"] == "full"]
        found = sum(1 for s in passkeys if s["score"] == 1)
        check(found >= 1, f"full found the pass key in {found} of {len(passkeys)} prompts "
                          f"({[s['answer'] for s in passkeys]})")

        check(h.returncode == 0 and os.path.exists(http_path),
              f"the suite runs over the HTTP API (exit {h.returncode})")
        if os.path.exists(http_path):
            with open(http_path) as f:
                over_http = json.load(f)

            def answers(samples):
                return sorted((s["method"], s["prompt_tokens"], s["answer"]) for s in samples
                              if s["task"] == "niah_single" and s["method"] in ("full", "exact"))
            check(answers(over_http["samples"]) == answers(result["samples"]),
                  "over HTTP, full and exact answer the needle prompts as over gRPC")

        # A broken method: exact's answers replaced by wrong ones, as random rows would give.
        doctored = json.loads(json.dumps(result))
        for g in doctored["groups"]:
            if g["method"] == "exact":
                g["accuracy"] = 0.0
        doctored_path = os.path.join(tmp, "doctored.json")
        with open(doctored_path, "w") as f:
            json.dump(doctored, f)
        d = subprocess.run([args.kvr, "eval", "endpoint", "--gate", args.gate, "--results",
                            doctored_path], capture_output=True, text=True, timeout=60)
        print(d.stdout)
        check(d.returncode == 2, f"the doctored result fails the gate (exit {d.returncode})")
        streaming_acc = gate["accuracy"].get("streaming", 0)
        if streaming_acc > 0:
            check("exact: accuracy 0.0 is below streaming's" in d.stdout,
                  "... as below streaming")
        margin = f"{100 * gate.get('exact_margin', 0.02):.1f}"
        check(f"exact: accuracy 0.0 is more than {margin} points under full's" in d.stdout,
              f"... as more than {margin} points under full")
        tolerance = f"{100 * gate.get('tolerance', 0.05):.1f}"
        check(f"exact: accuracy 0.0 is more than {tolerance} points under its recorded"
              in d.stdout, f"... as more than {tolerance} points under its record")
        # A floor that every method is under: streaming's answers doctored to all correct.
        for g in doctored["groups"]:
            g["accuracy"] = 1.0 if g["method"] == "streaming" else \
                next(o["accuracy"] for o in result["groups"]
                     if (o["task"], o["method"], o["budget"]) == (g["task"], g["method"],
                                                                   g["budget"]))
        with open(doctored_path, "w") as f:
            json.dump(doctored, f)
        d = subprocess.run([args.kvr, "eval", "endpoint", "--gate", args.gate, "--results",
                            doctored_path], capture_output=True, text=True, timeout=60)
        print(d.stdout)
        check(d.returncode == 2 and "exact: accuracy" in d.stdout and
              "is below streaming's 100.0" in d.stdout,
              f"a method below streaming fails the gate (exit {d.returncode})")
        # The undoctored result passes the same way (the gate on a file is the gate on a run).
        u = subprocess.run([args.kvr, "eval", "endpoint", "--gate", args.gate, "--results",
                            result_path], capture_output=True, text=True, timeout=60)
        check(u.returncode == 0, f"the run's own result file passes (exit {u.returncode})")

    return check.result()


if __name__ == "__main__":
    sys.exit(main())
