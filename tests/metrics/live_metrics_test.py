#!/usr/bin/env python3
"""Live /metrics of real node processes: starts kvr-controller, kvr-store and, when
they are built and the test model is present, kvr-prefill and kvr-decode, each with
--metrics-port 0; reads the port each prints, GETs /metrics over HTTP and checks that the text
passes `promtool check metrics` and holds the node's kvr_node_info and its own metric families
(series without labels, or with the served model, exist before any request).
Environment (set by CTest): KVR_CONTROLLER_BIN, KVR_STORE_BIN, KVR_PREFILL_BIN, KVR_DECODE_BIN,
PROMTOOL_BIN, KVR_TEST_MODEL."""
import os
import subprocess
import sys
import unittest
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pylib"))
from child_process import Process  # noqa: E402

PROMTOOL = os.environ.get("PROMTOOL_BIN", "promtool")


def start_node(argv):
    """`argv` as a child whose output (stdout and stderr) is collected; stop() gives it 20 s
    after SIGTERM."""
    return Process(argv, stop_timeout=20)


def get_metrics(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        assert r.status == 200, r.status
        return r.read().decode()


def promtool_check(test, text, who):
    r = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True,
                       text=True)
    test.assertEqual(r.returncode, 0, f"{who}: promtool check metrics:\n{r.stdout}{r.stderr}")
    test.assertEqual(r.stdout + r.stderr, "", f"{who}: promtool warnings")


class LiveMetricsTest(unittest.TestCase):
    def scrape(self, node, port_line, listening_line, who, timeout=60):
        """The node's /metrics, promtool-clean, once it listens; its metrics port is the first
        group of `port_line`."""
        port = int(node.wait_match(port_line, timeout=timeout).group(1))
        node.wait_match(listening_line, timeout=60)
        text = get_metrics(port)
        promtool_check(self, text, who)
        return text

    def assertExposes(self, text, *lines):
        for line in lines:
            self.assertIn(line, text)

    def test_controller(self):
        node = start_node([os.environ["KVR_CONTROLLER_BIN"], "--listen", "127.0.0.1:0",
                           "--metrics-port", "0"])
        try:
            text = self.scrape(node, r"kvr-controller metrics on [^:]+:(\d+)",
                               "kvr-controller listening on", "kvr-controller")
            self.assertExposes(text, 'kvr_node_info{name="kvr-controller",role="controller"} 1',
                               "kvr_build_info{", "kvr_requests_running 0")
        finally:
            node.stop()

    def test_controller_metrics_off(self):
        node = start_node([os.environ["KVR_CONTROLLER_BIN"], "--listen", "127.0.0.1:0",
                           "--metrics-port", "-1"])
        try:
            node.wait_match("kvr-controller listening on", timeout=60)
            self.assertFalse(any("metrics on" in line for line in node.lines), node.lines)
        finally:
            node.stop()

    def test_store(self):
        node = start_node([os.environ["KVR_STORE_BIN"], "--listen", "127.0.0.1:0",
                           "--metrics-port", "0", "--capacity-bytes", "64MiB", "--huge-pages",
                           "false", "--name", "store-a"])
        try:
            text = self.scrape(node, r"kvr-store metrics port=(\d+)", "kvr-store listening",
                               "kvr-store")
            self.assertExposes(text, 'kvr_node_info{name="store-a",role="store"} 1',
                               f"kvr_store_capacity_bytes {64 << 20}", "kvr_store_used_bytes 0",
                               'kvr_store_evictions_total{reason="expired"} 0',
                               'kvr_store_evictions_total{reason="cached_lru"} 0',
                               "kvr_store_shared_pages 0", "kvr_store_forks_total 0")
            self.assertRegex(text, r'kvr_store_pages\{state="free"\} \d+')
        finally:
            node.stop()

    def check_model_node(self, role, name_flag):
        binary = os.environ.get(f"KVR_{role.upper()}_BIN")
        model = os.environ.get("KVR_TEST_MODEL") or os.path.expanduser(
            "~/.cache/kvr/models/SmolLM2-135M-Instruct.Q4_1.gguf")
        if not binary:
            self.skipTest(f"kvr-{role} is not built in this tree")
        if not os.path.exists(model):
            self.skipTest(f"test model {model} missing (scripts/fetch-model.sh)")
        # No controller: the node keeps retrying registration, which does not matter here.
        node = start_node([binary, "--model", model, "--listen", "127.0.0.1:0",
                           "--metrics-port", "0", "--controller", "127.0.0.1:1", name_flag,
                           f"{role}-a"])
        try:
            text = self.scrape(node, rf"kvr-{role} metrics on [^:]+:(\d+)",
                               f"kvr-{role} listening on", f"kvr-{role}", timeout=90)
            self.assertExposes(text, f'kvr_node_info{{name="{role}-a",role="{role}"}} 1',
                               f'kvr_requests_waiting{{role="{role}"}} 0')
            return text
        finally:
            node.stop()

    def test_prefill(self):
        text = self.check_model_node("prefill", "--node-name")
        self.assertRegex(text, r'kvr_kv_shipped_bytes_total\{destination="store",model="[^"]+"\} 0')

    def test_decode(self):
        text = self.check_model_node("decode", "--name")
        self.assertRegex(text, r'kvr_decode_tokens_total\{model="[^"]+"\} 0')
        self.assertRegex(text, r'kvr_decode_batch_size\{model="[^"]+"\} 0')

if __name__ == "__main__":
    unittest.main()
