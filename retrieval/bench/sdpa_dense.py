#!/usr/bin/env python3
"""Dense decode attention with torch SDPA (the anchor for decode_attention_bench), and the joined
per-layer table.

Times torch.nn.functional.scaled_dot_product_attention for one query token per sequence over the
whole context: Llama-3-8B attention shape (32 q / 8 kv heads, head_dim 128, bf16), contexts x
batches as the C++ bench. K/V are [batch, 8, ctx, 128] (enable_gqa: no copy of the 8 kv heads to
32). Median of CUDA-event timings over rotating K/V buffers (> L2), after warm-up.

  python3 sdpa_dense.py --contexts 8192,32768,131072 --batches 1,4,16 --out sdpa.csv
  python3 sdpa_dense.py --join bench.csv --sdpa sdpa.csv   # the ratio table (no GPU needed)
"""
import argparse
import csv
import statistics
import sys


def time_sdpa(contexts, batches, iters):
    import torch
    import torch.nn.functional as F

    dev = torch.device("cuda")
    rows = []
    for ctx in contexts:
        for batch in batches:
            kv_bytes = 2 * batch * 8 * ctx * 128 * 2
            # Two K/V sets when they fit easily, so consecutive calls do not share L2 lines.
            n_sets = 2 if kv_bytes * 2 < 40 * 2**30 else 1
            q = torch.randn(batch, 32, 1, 128, device=dev, dtype=torch.bfloat16)
            kvs = [(torch.randn(batch, 8, ctx, 128, device=dev, dtype=torch.bfloat16),
                    torch.randn(batch, 8, ctx, 128, device=dev, dtype=torch.bfloat16))
                   for _ in range(n_sets)]

            def call(i):
                k, v = kvs[i % n_sets]
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

            for i in range(5):
                call(i)
            torch.cuda.synchronize()
            times = []
            for i in range(iters):
                a = torch.cuda.Event(enable_timing=True)
                b = torch.cuda.Event(enable_timing=True)
                a.record()
                call(i)
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) * 1000.0)
            us = statistics.median(times)
            gbs = kv_bytes / (us * 1e3)
            rows.append({"ctx": ctx, "batch": batch, "sdpa_us": round(us, 1),
                         "sdpa_gbs": round(gbs, 0)})
            print(f"sdpa ctx={ctx} batch={batch} {us:.1f} us/layer {gbs:.0f} GB/s", flush=True)
            del kvs, q
            torch.cuda.empty_cache()
    return rows


def join(bench_csv, sdpa_csv):
    """Prints the per-layer table (us per layer, and the ratio to SDPA dense of the same run).
    Stage times are CUDA-graph replays (GPU time, no per-launch host overhead) except gather HBM,
    which is stream-launched; hot's hit rate is from stream-launched steps of the chain. E+G+A is
    one captured graph of exact select + host gather + attend; the other sums are composed from
    the stage times."""
    sdpa = {}
    with open(sdpa_csv) as f:
        for r in csv.DictReader(f):
            sdpa[(int(r["ctx"]), int(r["batch"]))] = float(r["sdpa_us"])
    with open(bench_csv) as f:
        rows = list(csv.DictReader(f))
    if not rows:
        sys.exit("join: empty bench csv")
    r0 = rows[0]
    print(f"ceilings: HBM copy {float(r0['hbm_copy_gbs']):.0f} GB/s (read+write), "
          f"pinned H2D memcpy {float(r0['h2d_gbs']):.1f} GB/s")
    hdr = ("| ctx | batch | k | SDPA | exact sel | quest sel | gather host | gather HBM | attend "
           "| fused host | hot (hit) | E+G+A (x SDPA) | Q+G+A (x) | Q+hot+A (x) | G+A (x) "
           "| hot+A (x) | host GB/s (x memcpy) | HBM GB/s (frac) | ok |")
    print(hdr)
    print("|" + "---|" * (hdr.count("|") - 1))
    for r in rows:
        key = (int(r["ctx"]), int(r["batch"]))
        s = sdpa.get(key)
        f = {k: float(v) for k, v in r.items()}

        def us_x(x):
            return f"{x:.1f} ({x / s:.3f})" if s else f"{x:.1f}"

        step_bytes = key[1] * 8 * f["budget"] * 512
        gh = f["gather_host_graph_us"]
        at = f["attend_graph_us"]
        qs = f.get("quest_graph_us", 0.0)
        hot = f.get("hot_graph_us", f["hot_us"])
        host_gbs = step_bytes / (gh * 1e3)
        print(f"| {key[0] // 1024}K | {key[1]} | {int(f['budget'])} | "
              f"{s if s else 'n/a'} | {f['select_graph_us']:.1f} | {qs:.1f} | {gh:.1f} | "
              f"{f['gather_hbm_us']:.1f} | {at:.1f} | {f['fused_host_graph_us']:.1f} | "
              f"{hot:.1f} ({f['hit_rate']:.2f}) | {us_x(f['total_host_graph_us'])} | "
              f"{us_x(qs + gh + at)} | {us_x(qs + hot + at)} | {us_x(gh + at)} | "
              f"{us_x(hot + at)} | {host_gbs:.1f} ({host_gbs / f['h2d_gbs']:.2f}) | "
              f"{f['gather_hbm_gbs']:.0f} ({f['gather_hbm_frac']:.2f}) | "
              f"{'yes' if f['verified'] else 'NO'} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="8192,32768,131072")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default="sdpa.csv")
    ap.add_argument("--join", help="decode_attention_bench CSV: print the ratio table")
    ap.add_argument("--sdpa", help="SDPA CSV for --join")
    a = ap.parse_args()
    if a.join:
        join(a.join, a.sdpa or a.out)
        return
    rows = time_sdpa([int(x) for x in a.contexts.split(",")],
                     [int(x) for x in a.batches.split(",")], a.iters)
    with open(a.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
