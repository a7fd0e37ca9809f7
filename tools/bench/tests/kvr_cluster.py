"""Local kvr clusters of real processes for the `kvr bench` and observability tests (Python
standard library only): kvr-controller plus controller_fake_node nodes, and a helper that runs
`kvr bench` as a process."""
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..",
                                "tests", "pylib"))
from child_process import Process  # noqa: E402


class FakeCluster:
    """kvr-controller on a free port with one prefill, one decode and one store fake node."""

    def __init__(self, controller_bin, fake_node_bin, token_delay_ms=5, extra_controller_args=()):
        self.processes = []
        self.controller = self._start(
            [controller_bin, "--listen", "127.0.0.1:0", "--lease-seconds", "5",
             "--shutdown-grace-seconds", "1", *extra_controller_args], "controller")
        line = self.controller.wait_for("kvr-controller listening on")
        self.address = line.split()[-1]
        # The OpenAI-compatible HTTP API (printed before the gRPC line).
        http = self.controller.wait_for("kvr-controller http listening on").split()[-1]
        self.base_url = f"http://{http}/v1"
        self.nodes = []
        for role, args in (("store", []),
                           ("prefill", ["--context-length", "1000000"]),
                           ("decode", ["--context-length", "1000000", "--batch-slots", "256",
                                       "--token-delay-ms", str(token_delay_ms)])):
            node = self._start([fake_node_bin, "--controller", self.address, "--role", role,
                                *args], "fake-" + role)
            node.wait_for("registered")
            self.nodes.append(node)

    def _start(self, argv, name):
        p = Process(argv, name)
        self.processes.append(p)
        return p

    def stop(self):
        for p in reversed(self.processes):
            p.stop()


def run_bench(kvr_bin, target, args, timeout=60):
    """Runs `kvr bench --target TARGET --no-progress ARGS` (no --target when TARGET is None:
    the openai backends take --base-url); returns the CompletedProcess."""
    target_args = [] if target is None else ["--target", target]
    return subprocess.run([kvr_bin, "bench", *target_args, "--no-progress", *args],
                          capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ))
