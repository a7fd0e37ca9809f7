"""Dense causal prefill attention per layer (torch SDPA, flash backend) at Llama-3-8B shapes:
32 query / 8 KV heads (K/V repeated to 32 heads, as a GQA prefill kernel reads them), head_dim 128,
bf16, batch 1: the anchor that build_cuda_bench's per-layer summary-building times are compared
with (scripts/device/kernels-build.sh runs both in one device call).

    python3 prefill_sdpa.py [--contexts 8192,32768,131072] [--iters 3]
"""
import argparse

import torch
import torch.nn.functional as F


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="8192,32768,131072")
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(f"prefill SDPA on {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print(f"{'context':>8} {'us/layer':>12} {'TF/s':>8}")
    for L in [int(x) for x in args.contexts.split(",")]:
        q = torch.randn(1, 32, L, 128, device=dev, dtype=torch.bfloat16)
        k = torch.randn(1, 8, L, 128, device=dev, dtype=torch.bfloat16).repeat_interleave(4, 1)
        v = torch.randn(1, 8, L, 128, device=dev, dtype=torch.bfloat16).repeat_interleave(4, 1)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.cuda.synchronize()
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(args.iters):
                F.scaled_dot_product_attention(q, k, v, is_causal=True)
            b.record()
            torch.cuda.synchronize()
        us = 1000.0 * a.elapsed_time(b) / args.iters
        flops = 4.0 * L * L * 128 * 32 / 2  # causal: half of QK^T and PV
        print(f"{L:>8} {us:>12.1f} {flops / us / 1e6:>8.1f}")
        del q, k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
