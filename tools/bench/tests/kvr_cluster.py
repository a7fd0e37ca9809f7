"""Local kvr clusters of real processes for the `kvr bench` and observability tests (Python
standard library only): kvr-controller plus controller_fake_node nodes, and a helper that runs
`kvr bench` as a process."""
import os
import subprocess
import tempfile
import threading
import time


class Process:
    """A child process whose stdout lines can be waited for."""

    def __init__(self, argv, log_name):
        self.argv = argv
        self.log = tempfile.NamedTemporaryFile("w+", prefix=log_name + "-", suffix=".log",
                                               delete=False)
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.lines = []
        self.cv = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            with self.cv:
                self.lines.append(line.rstrip("\n"))
                self.cv.notify_all()
        with self.cv:
            self.cv.notify_all()

    def wait_for(self, prefix, timeout=20.0):
        """The first stdout line starting with `prefix`; raises on timeout or exit."""
        deadline = time.monotonic() + timeout
        with self.cv:
            while True:
                for line in self.lines:
                    if line.startswith(prefix):
                        return line
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.argv[0]}: no line starting with {prefix!r} "
                        f"(exit {self.proc.poll()}); stderr in {self.log.name}")
                self.cv.wait(min(left, 0.2))

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


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
