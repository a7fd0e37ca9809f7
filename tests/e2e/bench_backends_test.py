#!/usr/bin/env python3
"""`kvr bench` against both front doors of ONE `kvr up` cluster (SmolLM2 on the CPU):
--backend openai-chat against the controller's OpenAI-compatible HTTP API and --backend
kvr-grpc --chat against its gRPC API, with the same prompts (seeded), the same chat template
and --ignore-eos. Both runs must succeed with every request, and their request counts and the
server-reported token totals must be equal (the same work went through either door).

Usage: bench_backends_test.py --kvr build/tools/kvr   (KVR_TEST_MODEL: the GGUF; exit 77 when
it is missing). Prints each run's median TTFT and what the client side added to the controller's
own TTFT (server_ttfts). Python standard library only.
"""

import json
import os
import subprocess
import sys
import tempfile

from kvr_up import SKIP, Checks, Cluster, parse_args
NUM_PROMPTS = 6
RUN_ARGS = ["--num-prompts", str(NUM_PROMPTS), "--concurrency", "2", "--input-len", "48",
            "--output-len", "4", "--ignore-eos", "--seed", "3", "--no-progress"]


def bench(kvr, args, result_file):
    r = subprocess.run([kvr, "bench", *args, *RUN_ARGS, "--result-file", result_file],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise AssertionError(f"kvr bench {args} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    with open(result_file) as f:
        return json.load(f)


def main():
    args = parse_args()
    if args is None:
        return SKIP

    check = Checks()

    with tempfile.TemporaryDirectory(prefix="kvr-bench-backends-") as tmp:
        # The controller counts a placed request against the decode node until its next
        # heartbeat: more slots than the default 8 keep short back-to-back requests from being
        # refused with RESOURCE_EXHAUSTED on a slow machine.
        cluster = Cluster(args.kvr, os.path.join(tmp, "logs"),
                          ["--store-capacity", "512MiB", "--decode-arg=--batch-slots=32"],
                          ready_timeout=120)
        try:
            # HTTPS with kvr up's CA, which --tls-ca gives the HTTP backend too.
            check(cluster.base_url.startswith("https://"),
                  f"kvr up serves HTTPS: {cluster.base_url}")
            http = bench(args.kvr, ["--backend", "openai-chat", "--base-url", cluster.base_url,
                                    *cluster.grpc_args],
                         os.path.join(tmp, "http.json"))
            grpc = bench(args.kvr, ["--backend", "kvr-grpc", "--chat", "--target", cluster.grpc,
                                    *cluster.grpc_args],
                         os.path.join(tmp, "grpc.json"))
        finally:
            cluster.stop()

    for name, j in (("openai-chat", http), ("kvr-grpc", grpc)):
        check(j["backend"] == name, f"{name}: the JSON names its backend ({j['backend']})")
        check(j["completed"] == NUM_PROMPTS and j["failed"] == 0,
              f"{name}: {j['completed']} of {NUM_PROMPTS} completed, {j['failed']} failed "
              f"{j['errors']}")
        check(all(t > 0 for t in j["ttfts"]), f"{name}: every request has a TTFT")
        # The controller's own TTFT comes back on both doors and is inside the client's.
        check(all(s is not None and 0 < s <= t for s, t in zip(j["server_ttfts"], j["ttfts"])),
              f"{name}: every request has a server TTFT below the client's")
        print(f"      {name}: median TTFT {j['median_ttft_ms']:.2f} ms, "
              f"median E2E {j['median_e2el_ms']:.2f} ms")
    check(http["num_prompts"] == grpc["num_prompts"] and http["completed"] == grpc["completed"],
          f"request counts equal: http {http['completed']}/{http['num_prompts']}, "
          f"grpc {grpc['completed']}/{grpc['num_prompts']}")
    # Token totals as the nodes counted them: the same prompts through the same chat template,
    # and --ignore-eos makes every request generate its 4 tokens.
    check(http["total_input_tokens"] == grpc["total_input_tokens"],
          f"prompt tokens equal: http {http['total_input_tokens']}, "
          f"grpc {grpc['total_input_tokens']}")
    check(http["output_lens"] == grpc["output_lens"] == [4] * NUM_PROMPTS,
          f"output tokens: http {http['output_lens']}, grpc {grpc['output_lens']}")
    for name, j in (("openai-chat", http), ("kvr-grpc", grpc)):
        added = sorted(1000 * (t - s) for s, t in zip(j["server_ttfts"], j["ttfts"]))
        print(f"      {name}: client TTFT minus the controller's, median "
              f"{added[len(added) // 2]:.2f} ms")
    return check.result()


if __name__ == "__main__":
    sys.exit(main())
