"""A `kvr up` cluster for the Python end-to-end tests: started on free loopback ports
(--base-port 0) with SmolLM2, the addresses it prints parsed, stopped on exit; and the tests'
checks. Standard library only."""

import argparse
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pylib"))
from child_process import Process  # noqa: E402

SKIP = 77
MODEL = "smollm2-135m-instruct"


class Checks:
    """A test's checks: each call prints "ok" or "FAIL" and what was checked, and remembers the
    failed ones. result() prints how many failed in how long (since `start`, set at
    construction) and returns the exit status, 1 when any did."""

    def __init__(self):
        self.failures = []
        self.start = time.time()

    def __call__(self, cond, what):
        print(("ok    " if cond else "FAIL  ") + what)
        if not cond:
            self.failures.append(what)

    def result(self):
        print(f"{len(self.failures)} failure(s) in {time.time() - self.start:.1f} s")
        return 1 if self.failures else 0


def test_model():
    """The GGUF path (KVR_TEST_MODEL, else the fetch-model cache), exported for `kvr up`; None
    when it is missing (the caller exits SKIP)."""
    path = os.environ.get("KVR_TEST_MODEL") or os.path.expanduser(
        "~/.cache/kvr/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.exists(path):
        print(f"skip: no test model at {path} (scripts/fetch-model.sh)")
        return None
    os.environ["KVR_TEST_MODEL"] = path
    return path


def parse_args(*flags):
    """The command line of an e2e script: --kvr and each of `flags`, all required. None when
    the test model is missing (test_model; the caller exits SKIP)."""
    parser = argparse.ArgumentParser()
    for flag in ("--kvr", *flags):
        parser.add_argument(flag, required=True)
    args = parser.parse_args()
    return args if test_model() is not None else None


class Cluster:
    """`kvr up --prefill 1 --decode 1` on free loopback ports; grpc, base_url and
    store_metrics are the addresses it prints, ca the CA kvr up made (None with --insecure),
    grpc_args the TLS arguments a client of the cluster (kvr generate --endpoint, kvr bench)
    needs: the cluster's gRPC is TLS and its HTTP API HTTPS (base_url https://...) with that
    CA, unless `args` has --insecure. `args`: more `kvr up` arguments; `env`: its environment
    (default: this process's)."""

    def __init__(self, kvr, log_dir, args=(), env=None, ready_timeout=240):
        # The reader thread keeps draining stdout, so that kvr up never blocks on a full pipe.
        self.up = Process([kvr, "up", "--model", MODEL, "--prefill", "1", "--decode", "1",
                           "--base-port", "0", "--log-dir", log_dir, *args],
                          env=env, stop_timeout=30)
        try:
            self.up.wait_match("kvr up: ready", timeout=ready_timeout)
        except RuntimeError as e:
            self.stop()
            raise RuntimeError(f"kvr up did not get ready: {e}") from None
        text = "\n".join(self.up.lines)
        self.grpc = re.search(r"public gRPC \(kvr.v1.Generation\)\s+(\S+)", text).group(1)
        self.base_url = re.search(r"OpenAI-compatible HTTP\s+(https?://\S+)", text).group(1)
        self.store_metrics = re.search(r"store-0 .* metrics (\S+)", text).group(1)
        ca = re.search(r"^\s*tls ca (\S+)", text, re.MULTILINE)
        self.ca = ca.group(1) if ca else None
        self.grpc_args = ["--tls-ca", self.ca] if ca else []

    def stop(self):
        self.up.stop()
