#!/usr/bin/env python3
"""The GPU decode data path's per-method per-layer table, composed from ONE device call
(scripts/device/issue6-table.sh run): select_cuda_bench (all six selectors),
decode_attention_bench (gather from host / hot cache / attend, the ceilings) and sdpa_dense.py
(torch SDPA dense decode), each on the Llama-3-8B attention shape (32 q / 8 kv heads, d 128,
bf16 K/V rows of 512 B).

  python3 issue6_table.py --dir OUT      # OUT holds the run's logs (names as the script writes)

Per (ctx, batch, budget, method), us per layer:
  select   select_cuda_bench, stream-launched back-to-back (CUDA events over `iters` launches;
           includes host launch gaps where a selector's kernels are shorter than the launches)
  gather   decode_attention_bench gather_host_graph_us: GatherRows zero-copy from mapped pinned
           host memory, CUDA-graph replay
  hot      hot_graph_us: HotCache::Gather at steady state on a synthetic chain where each step
           keeps `overlap` (0.7) of the previous step's ids; hit rate in brackets; hot90: the
           same at overlap 0.9 (128K only)
  attend   attend_graph_us: DecodeAttention over 512 resident + budget gathered rows
  S+G+A, S+hot+A, S+hot90+A: sums of the stage times (composed, not one captured step), and
           their ratio to SDPA dense decode of the same (ctx, batch), same call.
Gather, hot and attend do not depend on the method (same budget, same row count); the select
does, and so do the summary bytes per token and KV head (B/tok/kvh, from select_cuda_bench).
"""
import argparse
import csv
import io
import os
import re
import sys

METHODS = ["exact", "quest", "clusterkv", "pariskv", "ctkvr", "a2ats"]
KV_HEADS, ROW_BYTES, RESIDENT = 8, 512, 512
TARGET = 0.15


def read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def parse_decode(text):
    """decode_attention_bench stdout: 'ceilings:' line, zero-copy lines, CSV header + rows."""
    rows, header, ceil, zero = {}, None, {}, {}
    for line in text.splitlines():
        m = re.match(r"ceilings: hbm_copy ([\d.]+) GB/s .*pinned_h2d ([\d.]+) GB/s", line)
        if m:
            ceil = {"hbm": float(m.group(1)), "h2d": float(m.group(2))}
            continue
        m = re.match(r"ctx (\d+): zero-copy stream read at offset (\d+) MiB: ([\d.]+) GB/s", line)
        if m:
            k = int(m.group(1))
            zero[k] = max(zero.get(k, 0.0), float(m.group(3)))
            continue
        if line.startswith("ctx,batch,budget"):
            header = line.strip().split(",")
            continue
        if header and line[:1].isdigit():
            vals = line.strip().split(",")
            if len(vals) != len(header):
                continue
            r = {k: float(v) for k, v in zip(header, vals)}
            rows[(int(r["ctx"]), int(r["batch"]), int(r["budget"]))] = r
    return rows, ceil, zero


def parse_select(text):
    rows, header = {}, None
    for line in text.splitlines():
        if line.startswith("method,context"):
            header = line.strip().split(",")
            continue
        if not header or "," not in line:
            continue
        vals = line.strip().split(",")
        if len(vals) != len(header):
            continue
        r = dict(zip(header, vals))
        try:
            key = (r["method"], int(r["context"]), int(r["batch"]), int(r["budget"]))
            rows[key] = {k: float(v) for k, v in r.items() if k != "method"}
        except ValueError:
            continue
    return rows


def parse_sdpa(text):
    out = {}
    for m in re.finditer(r"sdpa ctx=(\d+) batch=(\d+) ([\d.]+) us/layer ([\d.]+) GB/s", text):
        out[(int(m.group(1)), int(m.group(2)))] = (float(m.group(3)), float(m.group(4)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--contexts", default="8192,32768,131072")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--budgets", default="256,1024")
    a = ap.parse_args()
    d = a.dir
    da, ceils, zero = {}, [], {}
    for name in ("da_128k.log", "da_rest.log"):
        rows, c, z = parse_decode(read(os.path.join(d, name)))
        da.update(rows)
        zero.update(z)
        if c:
            ceils.append((name, c))
    ov90, c90, _ = parse_decode(read(os.path.join(d, "da_ov90.log")))
    if c90:
        ceils.append(("da_ov90.log", c90))
    sel = {}
    for name in ("sel_128k.csv", "sel_rest.csv"):
        sel.update(parse_select(read(os.path.join(d, name))))
    sdpa = parse_sdpa(read(os.path.join(d, "sdpa.log")))
    stages = read(os.path.join(d, "stages.txt")).strip()
    gpu = read(os.path.join(d, "gpu.txt")).strip()
    contexts = [int(x) for x in a.contexts.split(",")]
    batches = [int(x) for x in a.batches.split(",")]
    budgets = [int(x) for x in a.budgets.split(",")]

    if gpu:
        print(f"GPU: {gpu}")
    if stages:
        print("stages:\n" + "\n".join("  " + s for s in stages.splitlines()))
    for name, c in ceils:
        print(f"ceilings ({name}): HBM device-to-device copy {c['hbm']:.0f} GB/s (read+write), "
              f"pinned host->device cudaMemcpy {c['h2d']:.1f} GB/s")
    if zero:
        print("zero-copy streaming read of the mapped host pool: " +
              ", ".join(f"{k // 1024}K {v:.1f} GB/s" for k, v in sorted(zero.items())))
    h2d = ceils[0][1]["h2d"] if ceils else None
    hbm = ceils[0][1]["hbm"] if ceils else None

    def x(us, s):
        return f"{us:.1f} ({us / s:.3f})" if s else f"{us:.1f}"

    hdr = ("| ctx | batch | k | method | SDPA us | select | gather host | hot (hit) | attend "
           "| S+G+A (x SDPA) | S+hot+A (x SDPA) | S+hot90+A (x SDPA) | B/tok/kvh "
           "| gather GB/s (x H2D, x zero-copy) |")
    print()
    print(hdr)
    print("|" + "---|" * (hdr.count("|") - 1))
    missing = []
    for ctx in contexts:
        for b in batches:
            s = sdpa.get((ctx, b), (None, None))[0]
            for k in budgets:
                r = da.get((ctx, b, k))
                r9 = ov90.get((ctx, b, k))
                if r is None:
                    missing.append(f"decode_attention_bench {ctx // 1024}K/b{b}/k{k}")
                for m in METHODS:
                    sr = sel.get((m, ctx, b, k))
                    if sr is None:
                        missing.append(f"select {m} {ctx // 1024}K/b{b}/k{k}")
                    cells = [f"{ctx // 1024}K", str(b), str(k), m, f"{s:.1f}" if s else "n/a"]
                    su = sr["us_per_layer"] if sr else None
                    cells.append(f"{su:.1f}" if su is not None else "n/a")
                    if r:
                        gh, at = r["gather_host_graph_us"], r["attend_graph_us"]
                        hot = r["hot_graph_us"]
                        cells += [f"{gh:.1f}", f"{hot:.1f} ({r['hit_rate']:.2f})", f"{at:.1f}"]
                    else:
                        cells += ["n/a"] * 3
                    if r and su is not None:
                        cells.append(x(su + gh + at, s))
                        cells.append(x(su + hot + at, s))
                    else:
                        cells += ["n/a", "n/a"]
                    if r9 and su is not None:
                        h9 = r9["hot_graph_us"]
                        cells.append(f"{x(su + h9 + r9['attend_graph_us'], s)} "
                                     f"[hot {h9:.1f} ({r9['hit_rate']:.2f})]")
                    else:
                        cells.append("-")
                    cells.append(f"{sr['bytes_per_token']:.1f}" if sr else "n/a")
                    if r:
                        gbs = b * KV_HEADS * k * ROW_BYTES / (gh * 1e3)
                        z = zero.get(ctx)
                        cells.append(f"{gbs:.1f} ({gbs / r['h2d_gbs']:.2f}"
                                     + (f", {gbs / z:.2f})" if z else ")"))
                    else:
                        cells.append("n/a")
                    print("| " + " | ".join(cells) + " |")
    if missing:
        print(f"\nmissing ({len(missing)}): " + "; ".join(missing[:20]) +
              (" ..." if len(missing) > 20 else ""))

    # Cross-check: exact / quest select timed both ways in the same call.
    print("\nselect, two benches (128K, budget 1024): select_cuda_bench stream-launched "
          "(sink 16, local 256) vs decode_attention_bench CUDA graph (sink 64, local 448):")
    for b in batches:
        r = da.get((131072, b, 1024))
        e = sel.get(("exact", 131072, b, 1024))
        q = sel.get(("quest", 131072, b, 1024))
        if r and e and q:
            print(f"  b{b}: exact {e['us_per_layer']:.1f} vs {r['select_graph_us']:.1f} (graph), "
                  f"quest {q['us_per_layer']:.1f} vs {r['quest_graph_us']:.1f} (graph)")

    # The target: 128K, batch 1, budget 1024, select + gather (host) + attend <= 0.15x SDPA.
    ctx, b, k = 131072, 1, 1024
    s = sdpa.get((ctx, b), (None, None))[0]
    r, r9 = da.get((ctx, b, k)), ov90.get((ctx, b, k))
    print(f"\ntarget: 128K, batch 1, budget 1024: S+G+A <= {TARGET} x SDPA"
          + (f" = {TARGET * s:.1f} us (SDPA {s:.1f} us)" if s else " (no SDPA figure)"))
    if not (s and r and hbm and h2d):
        print("  not computable (missing rows)")
        return
    step = b * KV_HEADS * k * ROW_BYTES
    att_bytes = b * KV_HEADS * (RESIDENT + k) * ROW_BYTES
    gh, at, hot = r["gather_host_graph_us"], r["attend_graph_us"], r["hot_graph_us"]
    hr = r["hit_rate"]
    print(f"  data path (same for every method): gather {step / 2**20:.1f} MiB from host in "
          f"{gh:.1f} us = {step / (gh * 1e3):.1f} GB/s = {step / (gh * 1e3) / h2d:.2f} of the "
          f"{h2d:.1f} GB/s memcpy ceiling (floor {step / (h2d * 1e3):.1f} us); hot at "
          f"{hr:.2f} hits moves {(1 - hr) * step / 2**20:.2f} MiB in {hot:.1f} us"
          + (f", at {r9['hit_rate']:.2f} hits {(1 - r9['hit_rate']) * step / 2**20:.2f} MiB in "
             f"{r9['hot_graph_us']:.1f} us" if r9 else "")
          + f"; attend reads {att_bytes / 2**20:.1f} MiB in {at:.1f} us "
          f"(floor at HBM copy rate {att_bytes / (hbm * 1e3):.1f} us)")
    print("| method | select us | summary MiB scanned | select floor us (HBM) | S+G+A x SDPA "
          "| S+hot+A x | S+hot90+A x | target (S+G+A) | floor S+G+A us (x SDPA) "
          "| floor S+hot+A us (x SDPA) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for m in METHODS:
        sr = sel.get((m, ctx, b, k))
        if not sr:
            print(f"| {m} | n/a | | | | | | not run | | |")
            continue
        su = sr["us_per_layer"]
        mib = sr["summary_mib"]
        sfloor = mib * 2**20 / (hbm * 1e3)
        sga = (su + gh + at) / s
        sha = (su + hot + at) / s
        s9 = (su + r9["hot_graph_us"] + r9["attend_graph_us"]) / s if r9 else None
        floor = sfloor + step / (h2d * 1e3) + att_bytes / (hbm * 1e3)
        hfloor = sfloor + (1 - hr) * step / (h2d * 1e3) + att_bytes / (hbm * 1e3)
        verdict = ("met" if sga <= TARGET else
                   f"missed by {(su + gh + at) - TARGET * s:.1f} us")
        print(f"| {m} | {su:.1f} | {mib:.1f} | {sfloor:.1f} | {sga:.3f} | {sha:.3f} | "
              + (f"{s9:.3f}" if s9 is not None else "-")
              + f" | {verdict} | {floor:.1f} ({floor / s:.3f}) | {hfloor:.1f} ({hfloor / s:.3f}) |")


if __name__ == "__main__":
    sys.exit(main())
