#!/usr/bin/env python3
"""Dense-attention anchor for cuda_model_bench: torch's scaled_dot_product_attention on the
Llama-3-8B attention shape (32 query heads, 8 KV heads, head_dim 128, bf16), per layer and
for all 32 layers, in the same device call as the benchmark so that ratios come from one run.

  python3 model/bench/cuda_model_bench_sdpa.py --prefill 2048,8192 --batch 1,8,32 --context 4096
"""
import argparse

import torch
import torch.nn.functional as F


def time_ms(fn, reps=20, warmup=3):
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", default="2048,8192")
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args()
    heads, kv_heads, dim = 32, 8, 128
    dev, dt = "cuda", torch.bfloat16
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print("\nsdpa prefill (causal, enable_gqa)")
    print(f"{'tokens':>7} {'layer_ms':>9} {f'x{args.layers}_ms':>9} {'TF/s':>7}")
    for t in [int(x) for x in args.prefill.split(",") if x]:
        q = torch.randn(1, heads, t, dim, device=dev, dtype=dt)
        k = torch.randn(1, kv_heads, t, dim, device=dev, dtype=dt)
        v = torch.randn(1, kv_heads, t, dim, device=dev, dtype=dt)
        ms = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                            enable_gqa=True))
        flops = 2.0 * t * t * dim * heads  # causal: half of 4 T^2 d per head
        print(f"{t:7d} {ms:9.3f} {ms * args.layers:9.1f} {flops / ms / 1e9:7.0f}")
    print(f"\nsdpa decode (one query, context {args.context}, enable_gqa)")
    print(f"{'batch':>6} {'layer_ms':>9} {f'x{args.layers}_ms':>9} {'GB/s':>7}")
    for b in [int(x) for x in args.batch.split(",") if x]:
        q = torch.randn(b, heads, 1, dim, device=dev, dtype=dt)
        k = torch.randn(b, kv_heads, args.context, dim, device=dev, dtype=dt)
        v = torch.randn(b, kv_heads, args.context, dim, device=dev, dtype=dt)
        ms = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        gbytes = 2 * k.numel() * 2 / 1e9
        print(f"{b:6d} {ms:9.3f} {ms * args.layers:9.2f} {gbytes / ms * 1e3:7.0f}")


if __name__ == "__main__":
    main()
