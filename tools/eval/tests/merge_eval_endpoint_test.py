#!/usr/bin/env python3
"""tools/scripts/merge_eval_endpoint.py: the groups recomputed from pooled answers, the seeds
kept apart when pairing with full, and runs of different settings refused."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts",
                      "merge_eval_endpoint.py")
sys.path.insert(0, os.path.dirname(SCRIPT))
import merge_eval_endpoint as m  # noqa: E402


def answer(method, index, score, agrees, success=True, out=5, ttft=100.0, latency=500.0):
    return {"task": "niah_single", "length": 1024, "index": index, "method": method,
            "budget": 0 if method == "full" else 64, "success": success,
            "error": "" if success else "14: unavailable", "answer": "x", "expected": ["1"],
            "score": score, "agrees_with_full": agrees, "prompt_tokens": 1000 if success else 0,
            "output_tokens": out, "ttft_ms": ttft, "latency_ms": latency}


def run(seed, samples, answers, **config):
    c = {"model": "m", "tasks": ["niah_single"], "methods": ["full", "exact"], "budgets": [64],
         "lengths": [1024], "context": 8192, "temperature": 0, "n_sink": 16,
         "local_window": 128, "backend": "kvr-grpc", "seed": seed, "samples": samples}
    c.update(config)
    return {"config": c, "groups": [], "samples": answers}


class MergeTest(unittest.TestCase):
    def setUp(self):
        # Seed 1: full right on both, exact right then wrong. Seed 2: full wrong, exact right
        # (its request to full failed: agreement unknown there).
        self.a = run(1, 2, [answer("full", 0, 1.0, True), answer("full", 1, 1.0, True),
                            answer("exact", 0, 1.0, True), answer("exact", 1, 0.0, False)])
        self.b = run(2, 1, [answer("full", 0, 0.0, None, success=False),
                            answer("exact", 0, 1.0, None, out=9, ttft=200.0, latency=1000.0)])

    def test_groups_are_recomputed_over_every_seed(self):
        merged = m.merge([self.a, self.b])
        self.assertEqual(merged["config"]["seed"], [1, 2])
        self.assertEqual(merged["config"]["samples"], 3)
        self.assertEqual(len(merged["samples"]), 6)
        groups = {g["method"]: g for g in merged["groups"]}
        full, exact = groups["full"], groups["exact"]
        self.assertEqual((full["samples"], full["failed"]), (3, 1))
        self.assertAlmostEqual(full["accuracy"], 2 / 3)  # the failed request scores 0
        self.assertEqual(full["agreement_with_full"], 1.0)  # over the two it answered
        self.assertAlmostEqual(full["mean_prompt_tokens"], 1000)  # completed requests only
        self.assertAlmostEqual(exact["accuracy"], 2 / 3)
        self.assertAlmostEqual(exact["agreement_with_full"], 0.5)
        # (4 + 4 + 8) tokens after the first over (400 + 400 + 800) ms.
        self.assertAlmostEqual(exact["output_tokens_per_s"], 10.0)
        self.assertAlmostEqual(exact["mean_ttft_ms"], 400 / 3)

    def test_pairs_with_full_within_a_seed_only(self):
        rows = m.compare(m.merge([self.a, self.b]))
        self.assertEqual(len(rows), 1)
        (task, length, method, budget, n, acc, ref, points, agree, lower, higher, p) = rows[0]
        self.assertEqual((method, n, lower, higher), ("exact", 3, 1, 1))
        self.assertAlmostEqual(points, 0.0)
        self.assertAlmostEqual(p, 1.0)

    def test_sign_test(self):
        self.assertAlmostEqual(m.sign_test(0, 0), 1.0)
        self.assertAlmostEqual(m.sign_test(5, 0), 2 / 32)
        self.assertAlmostEqual(m.sign_test(6, 0), 2 / 64)
        self.assertAlmostEqual(m.sign_test(1, 5), 2 * 7 / 64)

    def test_runs_of_other_settings_or_the_same_seed_are_refused(self):
        other = run(2, 1, self.b["samples"], local_window=512)
        with self.assertRaisesRegex(ValueError, "config.local_window"):
            m.merge([self.a, other])
        with self.assertRaisesRegex(ValueError, "config.seed 1"):
            m.merge([self.a, self.a])

    def test_command_line_writes_the_merged_json(self):
        with tempfile.TemporaryDirectory() as d:
            paths = []
            for i, r in enumerate((self.a, self.b)):
                paths.append(os.path.join(d, f"{i}.json"))
                with open(paths[-1], "w") as f:
                    json.dump(r, f)
            out = os.path.join(d, "merged.json")
            p = subprocess.run([sys.executable, SCRIPT] + paths + [out], capture_output=True,
                               text=True)
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertIn("exact", p.stdout)
            with open(out) as f:
                self.assertEqual(len(json.load(f)["samples"]), 6)
            p = subprocess.run([sys.executable, SCRIPT, paths[0], paths[0], out],
                               capture_output=True, text=True)
            self.assertEqual(p.returncode, 2)
            self.assertIn("config.seed", p.stderr)


if __name__ == "__main__":
    unittest.main()
