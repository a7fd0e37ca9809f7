#!/usr/bin/env python3
"""Prefix reuse on a `kvr up` cluster, through the OpenAI-compatible HTTP API (official `openai`
client, streaming chat completions, greedy):

  1. TTFT of a conversation's second turn (a long history: a Debian licence text as the system
     message, a question and its answer, then a new user message of about 50 tokens), served
     with the first turn's KV reused against the same request with `"kvr": {"prefix_cache":
     false}` (prefilled cold). Rounds interleave reused and cold; medians are reported, with the
     tokens each reused request took from the cache (usage.prompt_tokens_details.cached_tokens)
     and whether the reused and cold answers are the same text.
  2. Store bytes for N conversations over one shared system prompt (the store's
     kvr_store_used_bytes gauge): after the first conversation and after all N, against N
     private copies (N x the first).

Usage: prefix_reuse_bench.py --kvr build/tools/kvr [--history-tokens 3000] [--rounds 3]
       [--shared-tokens 2000] [--conversations 10] [--json out.json] [--up-arg=ARG ...]
Starts its own cluster (tests/e2e/kvr_up.py, loopback, free ports); KVR_TEST_MODEL names the
GGUF. Needs the `openai` package (scripts/python-env.sh installs it).
"""

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests",
                                "e2e"))
from kvr_up import MODEL, Cluster, test_model  # noqa: E402

LICENCE = "/usr/share/common-licenses/GPL-3"


def text_of_tokens(client, tokens, offset=0):
    """About `tokens` tokens of the licence text (from character `offset`), sized by asking the
    cluster how many tokens a first cut makes (usage.prompt_tokens of a 1-token request)."""
    with open(LICENCE, encoding="utf-8") as f:
        full = f.read()[offset:]
    chars = tokens * 4
    for _ in range(3):
        text = full[:chars]
        r = client.completions.create(model=MODEL, prompt=text, max_tokens=1, temperature=0,
                                      extra_body={"kvr": {"prefix_cache": False}})
        got = r.usage.prompt_tokens
        if abs(got - tokens) <= tokens // 50:
            return text
        chars = int(chars * tokens / got)
    return full[:chars]


def chat(client, messages, reuse, max_tokens):
    """(ttft seconds, text, usage) of one streamed greedy chat completion."""
    t0 = time.perf_counter()
    ttft = None
    parts = []
    usage = None
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"kvr": {"prefix_cache": reuse}})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content is not None and ttft is None:
            ttft = time.perf_counter() - t0
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    return ttft if ttft is not None else time.perf_counter() - t0, "".join(parts), usage


def cached(usage):
    details = getattr(usage, "prompt_tokens_details", None)
    return getattr(details, "cached_tokens", 0) or 0


def store_used_bytes(cluster):
    with urllib.request.urlopen(f"http://{cluster.store_metrics}/metrics", timeout=5) as r:
        text = r.read().decode()
    return int(float(re.search(r"^kvr_store_used_bytes (\S+)", text, re.MULTILINE).group(1)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvr", required=True)
    ap.add_argument("--history-tokens", type=int, default=3000)
    ap.add_argument("--new-tokens", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shared-tokens", type=int, default=2000)
    ap.add_argument("--conversations", type=int, default=10)
    ap.add_argument("--json")
    ap.add_argument("--up-arg", action="append", default=[],
                    help="extra `kvr up` argument (repeatable), e.g. --up-arg=--prefill-arg=--chunk-tokens=256")
    args = ap.parse_args()
    if test_model() is None:
        sys.exit("no model: set KVR_TEST_MODEL")
    from openai import DefaultHttpxClient, OpenAI

    with tempfile.TemporaryDirectory(prefix="kvr-prefix-bench-") as log_dir:
        cluster = Cluster(args.kvr, log_dir, args=args.up_arg)
        try:
            # kvr up serves HTTPS with a CA of its own (plain HTTP with --up-arg=--insecure).
            client = OpenAI(base_url=cluster.base_url, api_key="unused", timeout=600,
                            http_client=DefaultHttpxClient(verify=cluster.ca or True))
            result = {"date": time.strftime("%Y-%m-%d"), "model": MODEL}

            # 1. Turn 2's TTFT, reused vs cold.
            history = text_of_tokens(client, args.history_tokens)
            turn1 = [{"role": "system", "content": history},
                     {"role": "user", "content": "In one sentence: what does section 2 allow?"}]
            _, answer1, u1 = chat(client, turn1, True, 32)
            new_text = text_of_tokens(client, args.new_tokens, offset=20000)
            rows = []
            for i in range(args.rounds):
                turn2 = turn1 + [{"role": "assistant", "content": answer1},
                                 {"role": "user",
                                  "content": f"Round {i}. Read this and name its topic: "
                                             f"{new_text}"}]
                # Alternate the order so that neither side always runs on a warmer machine.
                order = [True, False] if i % 2 == 0 else [False, True]
                got = {}
                for reuse in order:
                    got[reuse] = chat(client, turn2, reuse, 16)
                rows.append({
                    "prompt_tokens": got[True][2].prompt_tokens,
                    "cached_tokens": cached(got[True][2]),
                    "ttft_reused_s": got[True][0],
                    "ttft_cold_s": got[False][0],
                    "same_text": got[True][1] == got[False][1],
                })
                print(f"round {i}: prompt {rows[-1]['prompt_tokens']} tokens, "
                      f"{rows[-1]['cached_tokens']} reused: TTFT {got[True][0]:.3f} s reused, "
                      f"{got[False][0]:.3f} s cold; same text: {rows[-1]['same_text']}",
                      flush=True)
            reused = statistics.median(r["ttft_reused_s"] for r in rows)
            cold = statistics.median(r["ttft_cold_s"] for r in rows)
            result["turn2"] = {"history_tokens": u1.prompt_tokens, "rounds": rows,
                               "median_ttft_reused_s": reused, "median_ttft_cold_s": cold,
                               "speedup": cold / reused}
            print(f"turn 2 TTFT (median of {args.rounds}): reused {reused:.3f} s, cold "
                  f"{cold:.3f} s: {cold / reused:.1f}x lower")

            # 2. Store bytes of N conversations over one shared prompt.
            time.sleep(1)
            shared = text_of_tokens(client, args.shared_tokens, offset=8000)
            base = store_used_bytes(cluster)
            after = []
            for i in range(args.conversations):
                chat(client, [{"role": "system", "content": shared},
                              {"role": "user", "content": f"Question {i}: what is clause {i}?"}],
                     True, 8)
                time.sleep(0.3)  # the decode node's release
                after.append(store_used_bytes(cluster) - base)
            one = after[0]
            result["shared_prompt"] = {"conversations": args.conversations,
                                       "bytes_after_each": after,
                                       "bytes_shared": after[-1],
                                       "bytes_private_copies": one * args.conversations}
            print(f"store bytes for {args.conversations} conversations over one "
                  f"{args.shared_tokens}-token prompt: {after[-1] / 2**20:.1f} MiB shared vs "
                  f"{one * args.conversations / 2**20:.1f} MiB as private copies "
                  f"({one / 2**20:.1f} MiB each)")
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(result, f, indent=1)
        finally:
            cluster.stop()


if __name__ == "__main__":
    main()
