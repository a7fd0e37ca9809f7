#!/usr/bin/env python3
"""`kvr bench` as a process against a real kvr-controller with fake nodes
(controller_fake_node): every arrival mode, each dataset, every backend (kvr's gRPC API and the
controller's OpenAI-compatible HTTP API, chat and completions), a request-rate sweep, the JSON
(vllm layout, completed == requests sent), the PNG plot, and usage errors for bad arguments.

Environment: KVR_BIN, KVR_CONTROLLER_BIN, KVR_FAKE_NODE_BIN (set by CTest)."""
import json
import os
import sys
import tempfile
import unittest

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvr_cluster  # noqa: E402

KVR = os.environ.get("KVR_BIN", "kvr")
SMALL = ["--input-len", "32", "--output-len", "8"]


class BenchIntegrationTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.cluster = kvr_cluster.FakeCluster(os.environ["KVR_CONTROLLER_BIN"],
                                              os.environ["KVR_FAKE_NODE_BIN"])
        cls.tmp = tempfile.TemporaryDirectory()

    @classmethod
    def tearDownClass(cls):
        cls.cluster.stop()
        cls.tmp.cleanup()

    def bench(self, name, args, target="grpc"):
        """Runs kvr bench with --result-file NAME.json; target "grpc" adds --target ADDRESS,
        None adds nothing (the args name the backend and its --base-url)."""
        path = os.path.join(self.tmp.name, name + ".json")
        r = kvr_cluster.run_bench(KVR, self.cluster.address if target == "grpc" else target,
                                  [*args, "--result-file", path])
        self.assertEqual(r.returncode, 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}")
        self.assertIn("Serving Benchmark Result", r.stdout)
        with open(path) as f:
            return json.load(f)

    def assert_all_completed(self, j, n):
        self.assertEqual(j["completed"], n, j["errors"])
        self.assertEqual(j["failed"], 0)
        self.assertEqual(j["num_prompts"], n)
        for key in ("ttfts", "itls", "latencies", "input_lens", "output_lens", "errors",
                    "generated_texts"):
            self.assertEqual(len(j[key]), n, key)
        self.assertTrue(all(t > 0 for t in j["ttfts"]))
        self.assertGreater(j["request_throughput"], 0)

    def test_constant_rate(self):
        j = self.bench("constant", ["--rate", "40", "--num-prompts", "20", *SMALL])
        self.assert_all_completed(j, 20)
        self.assertEqual(j["request_rate"], 40)
        # The fake decode node streams exactly max_tokens tokens.
        self.assertEqual(j["output_lens"], [8] * 20)
        self.assertEqual(j["total_output_tokens"], 160)
        # 20 requests 25 ms apart: the last is sent ~475 ms after the first.
        self.assertGreater(max(j["start_times"]), 0.4)
        self.assertTrue(all(len(gaps) == 7 for gaps in j["itls"]))
        # The fake node reports 512 bytes fetched per token and 3 hits / 1 miss.
        self.assertAlmostEqual(j["retrieval_bytes_per_token"], 512.0)
        self.assertAlmostEqual(j["hot_cache_hit_rate"], 0.75)
        for stat in ("mean", "median", "std", "p90", "p99"):
            for metric in ("ttft", "tpot", "itl", "e2el"):
                self.assertIn(f"{stat}_{metric}_ms", j)

    def test_poisson_with_slo(self):
        j = self.bench("poisson", ["--rate", "40", "--poisson", "--seed", "5", "--num-prompts",
                                   "20", "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000",
                                   *SMALL])
        self.assert_all_completed(j, 20)
        # Generous SLOs: every completed request is good.
        self.assertAlmostEqual(j["request_goodput"], j["request_throughput"], places=6)

    def test_closed_loop_with_plot(self):
        png = os.path.join(self.tmp.name, "closed.png")
        # Warm-up requests are sent first and left out: the JSON still counts 12.
        j = self.bench("closed", ["--concurrency", "3", "--num-prompts", "12", "--num-warmups",
                                  "5", "--plot", png, *SMALL])
        self.assert_all_completed(j, 12)
        self.assertEqual(j["max_concurrency"], 3)
        self.assertEqual(j["request_rate"], "inf")
        # Never more than 3 requests in flight: count the overlaps at each send.
        spans = [(s, s + lat) for s, lat in zip(j["start_times"], j["latencies"])]
        for s, _ in spans:
            in_flight = sum(1 for a, b in spans if a <= s < b)
            self.assertLessEqual(in_flight, 3)
        with open(png, "rb") as f:
            self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")

    def test_duration_bounded(self):
        j = self.bench("duration", ["--rate", "20", "--duration", "1", *SMALL])
        self.assertGreaterEqual(j["completed"], 15)
        self.assertLessEqual(j["completed"], 21)
        self.assertEqual(j["failed"], 0)
        self.assertEqual(j["num_prompts"], j["completed"])

    def test_jsonl_dataset(self):
        path = os.path.join(self.tmp.name, "prompts.jsonl")
        with open(path, "w") as f:
            f.write(json.dumps({"prompt": "Tell me a story", "max_tokens": 3}) + "\n")
            f.write(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
        j = self.bench("jsonl", ["--dataset", "jsonl", "--dataset-path", path, "--num-prompts",
                                 "4", "--output-len", "5"])
        self.assert_all_completed(j, 4)
        self.assertEqual(j["output_lens"], [3, 5, 3, 5])

    def test_passkey_dataset_is_scored(self):
        j = self.bench("passkey", ["--dataset", "passkey", "--num-prompts", "3", "--input-len",
                                   "200", "--output-len", "4"])
        self.assert_all_completed(j, 3)
        # The fake node streams "t101 t102 ...", never the key.
        self.assertEqual(j["passkey_accuracy"], 0.0)

    def test_request_deadline_fails_requests_by_code(self):
        # 40 tokens 5 ms apart cannot finish within 50 ms.
        j = self.bench("deadline", ["--num-prompts", "3", "--input-len", "8", "--output-len",
                                    "40", "--request-timeout", "0.05"])
        self.assertEqual(j["completed"], 0)
        self.assertEqual(j["failed"], 3)
        self.assertEqual(j["error_counts"], {"DEADLINE_EXCEEDED": 3})
        self.assertTrue(all(e.startswith("DEADLINE_EXCEEDED") for e in j["errors"]))

    def test_openai_backends_over_http(self):
        for backend in ("openai-chat", "openai-completions"):
            with self.subTest(backend=backend):
                j = self.bench(backend, ["--backend", backend, "--base-url",
                                         self.cluster.base_url, "--num-prompts", "12",
                                         "--concurrency", "4", *SMALL], target=None)
                self.assert_all_completed(j, 12)
                self.assertEqual(j["backend"], backend)
                # Token counts from the usage chunk, kvr's counters from its "kvr" object.
                self.assertEqual(j["output_lens"], [8] * 12)
                self.assertTrue(all(len(gaps) == 7 for gaps in j["itls"]))
                self.assertAlmostEqual(j["retrieval_bytes_per_token"], 512.0)
                self.assertAlmostEqual(j["hot_cache_hit_rate"], 0.75)
                self.assertTrue(all(t.startswith("t") for t in j["generated_texts"]))

    def test_rate_sweep_writes_one_result_per_rate(self):
        path = os.path.join(self.tmp.name, "sweep.json")
        r = kvr_cluster.run_bench(KVR, self.cluster.address,
                                  ["--request-rate", "50,inf", "--num-prompts", "6",
                                   "--result-file", path, *SMALL])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.count("Serving Benchmark Result"), 2)
        self.assertFalse(os.path.exists(path))
        for name, rate in (("sweep-rate-50.json", 50), ("sweep-rate-inf.json", "inf")):
            with open(os.path.join(self.tmp.name, name)) as f:
                j = json.load(f)
            self.assert_all_completed(j, 6)
            self.assertEqual(j["request_rate"], rate)
        # 6 requests 20 ms apart take > 100 ms to send; all at once take none.
        with open(os.path.join(self.tmp.name, "sweep-rate-50.json")) as f:
            self.assertGreater(max(json.load(f)["start_times"]), 0.09)

    def test_sharegpt_dataset(self):
        path = os.path.join(self.tmp.name, "sharegpt.json")
        conversations = [{"id": str(i), "conversations": [
            {"from": "human", "value": f"please tell me about the number {i} today"},
            {"from": "gpt", "value": "it is a number " * (i + 2)}]} for i in range(5)]
        conversations.append({"id": "short", "conversations": [{"from": "human", "value": "hi"}]})
        with open(path, "w") as f:
            json.dump(conversations, f)
        j = self.bench("sharegpt", ["--backend", "openai-chat", "--base-url",
                                    self.cluster.base_url, "--dataset", "sharegpt",
                                    "--dataset-path", path, "--num-prompts", "5"], target=None)
        self.assert_all_completed(j, 5)
        # Each reply's length in words (4 per repetition) is the request's max_tokens.
        self.assertEqual(sorted(j["output_lens"]), [8, 12, 16, 20, 24])
        self.assertEqual(j["dataset"], "sharegpt")

    def test_bad_arguments_are_usage_errors(self):
        cases = [(["--rate", "-5"], "--rate"),
                 (["--dataset", "jsonl"], "--dataset-path"),
                 (["--dataset", "wiki"], "--dataset"),
                 (["--poisson"], "--rate"),
                 (["--concurrency", "0"], "--concurrency"),
                 (["--num-prompts", "ten"], "--num-prompts"),
                 (["--slo-ttft-ms", "0"], "--slo-ttft-ms"),
                 (["--request-rate", "1,fast"], "'fast' is not a positive number"),
                 (["--backend", "openai-chat"], "--target"),
                 (["--backend", "vllm"], "--backend"),
                 (["--base-url", "http://127.0.0.1:1/v1"], "--base-url"),
                 (["--dataset", "sharegpt"], "--dataset-path"),
                 (["--sharegpt-output-len", "5"], "--sharegpt-output-len")]
        for args, flag in cases:
            r = kvr_cluster.run_bench(KVR, self.cluster.address, args)
            self.assertNotEqual(r.returncode, 0, args)
            self.assertIn(flag, r.stdout + r.stderr, args)

    def test_openai_usage_errors(self):
        cases = [(["--backend", "openai-chat"], "--base-url: is required"),
                 (["--backend", "openai-chat", "--base-url", "127.0.0.1:80/v1"],
                  "must start with http://"),
                 (["--backend", "openai-chat", "--base-url", self.cluster.base_url, "--chat"],
                  "--chat")]
        for args, message in cases:
            r = kvr_cluster.run_bench(KVR, None, [*args, "--num-prompts", "1", *SMALL])
            self.assertNotEqual(r.returncode, 0, args)
            self.assertIn(message, r.stdout + r.stderr, args)
        # Chat messages cannot go to a completions endpoint: the run refuses before sending.
        path = os.path.join(self.tmp.name, "chat.jsonl")
        with open(path, "w") as f:
            f.write(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
        r = kvr_cluster.run_bench(KVR, None, ["--backend", "openai-completions", "--base-url",
                                              self.cluster.base_url, "--dataset", "jsonl",
                                              "--dataset-path", path, "--num-prompts", "1"])
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("use --backend openai-chat", r.stderr)

    def test_unreachable_openai_server_fails(self):
        r = kvr_cluster.run_bench(KVR, None, ["--backend", "openai-chat", "--base-url",
                                              "http://127.0.0.1:1/v1", "--num-prompts", "1",
                                              *SMALL])
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("http://127.0.0.1:1/v1/models", r.stderr)

    def test_unreachable_controller_fails(self):
        r = kvr_cluster.run_bench(KVR, "127.0.0.1:1", ["--num-prompts", "1", *SMALL])
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("ListModels", r.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
