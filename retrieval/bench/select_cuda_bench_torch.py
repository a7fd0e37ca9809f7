#!/usr/bin/env python3
"""Anchors for select_cuda_bench, timed in the same device call (scripts/device/kernels-select.sh).

Per (context, batch, budget), Llama-3-8B attention shape (32 q / 8 kv heads, d=128, bf16):
  sdpa_dense_us:  torch scaled_dot_product_attention decode (1 query token) over the whole K/V
  torch_exact_us: the same selection as kvr's `exact` in torch ops: q.k logits for the GQA
                  group (einsum, fp32), softmax per query head, sum over the group, topk(budget)
Same flags as select_cuda_bench (--contexts, --batches, --budgets, --iters). CUDA-event timing,
median of `iters` after warm-up.
"""
import argparse

import torch
import torch.nn.functional as F


def ints(s):
    return [int(x) for x in s.split(",")]


def time_us(fn, iters):
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    times.sort()
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="8192,32768,131072")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--budgets", default="256,1024")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--methods", default="exact")
    args = ap.parse_args()
    dev = "cuda"
    hq, hkv, d, sink, local = 32, 8, 128, 16, 256
    print(f"# torch {torch.__version__} on {torch.cuda.get_device_name()}")
    print(f"{'context':>8} {'batch':>6} {'budget':>7} {'sdpa_dense_us':>14} {'torch_exact_us':>15}")
    for ctx in ints(args.contexts):
        for b in ints(args.batches):
            k = torch.randn(b, hkv, ctx, d, device=dev, dtype=torch.bfloat16)
            v = torch.randn(b, hkv, ctx, d, device=dev, dtype=torch.bfloat16)
            q = torch.randn(b, hq, 1, d, device=dev, dtype=torch.bfloat16)
            sdpa = time_us(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                           args.iters)
            qg = q.view(b, hkv, hq // hkv, d).float()
            kc = k[:, :, sink:ctx - local]
            for budget in ints(args.budgets):
                if "exact" not in args.methods.split(","):  # SDPA anchor only
                    print(f"{ctx:>8} {b:>6} {budget:>7} {sdpa:>14.1f} {'-':>15}", flush=True)
                    continue

                def exact():
                    logits = torch.einsum("bhgd,bhnd->bhgn", qg, kc.float()) * d ** -0.5
                    agg = torch.softmax(logits, dim=-1).sum(dim=2)
                    return torch.topk(agg, budget, dim=-1).indices
                ex = time_us(exact, args.iters)
                print(f"{ctx:>8} {b:>6} {budget:>7} {sdpa:>14.1f} {ex:>15.1f}", flush=True)
            del k, v, q, qg, kc
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
