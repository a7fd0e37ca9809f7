#!/usr/bin/env python3
"""Checks kvr's GGUF dequantisation against the gguf Python package, bit for bit.

Runs the C++ tool `gguf_dequant_digest` on a GGUF file (sha256 of each tensor's float32 bytes)
and compares every line with the same digest computed from `gguf.GGUFReader` +
`gguf.quants.dequantize`.

  gguf_dequant_compare.py --tool BUILD/gguf_dequant_digest --model FILE.gguf
  gguf_dequant_compare.py --tool BUILD/gguf_dequant_digest --synthetic

--synthetic writes, into a temporary directory, a GGUF holding every type kvr dequantises
(F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K): quantised real-valued data
where the package can quantise, plus random valid blocks (random bits with sane fp16 scales) for
every block type, since the K-quants can only be dequantised by the package.

Exit status: 0 all equal, 1 mismatch or error, 77 (ctest SKIP) when --model does not exist.
"""

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES

# (type, byte offsets of fp16 scale fields inside one block)
BLOCK_SCALES = {
    Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0],
    Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208],
}
QUANTIZABLE = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.BF16]


def random_blocks(rng, qtype, n_blocks):
    """Random block bytes with every fp16 scale field set to a finite value of sane size."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for off in BLOCK_SCALES[qtype]:
        # Magnitudes from fp16 subnormals up to ~1, both signs.
        scale = (rng.standard_normal(n_blocks) * np.exp2(rng.uniform(-26, 0, n_blocks)))
        scale = scale.astype(np.float16)
        scale[::17] = np.float16(0.0)  # exact zero scales occur in real files
        blocks[:, off:off + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return blocks


def write_synthetic(path):
    rng = np.random.default_rng(1234)
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_uint32("kvr.test.u32", 7)
    shape = (6, 512)  # [rows, row length]: numpy order, ggml dims are (512, 6)
    values = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    values[0, :8] = [0.0, -0.0, 1e-8, -3.0, 65504.0, 1e-5, 0.5, -0.25]
    writer.add_tensor("plain.f32", values)
    # F16: random bit patterns (subnormals and infinities included, NaNs excluded because their
    # payload handling is not part of the contract) plus real values.
    f16_bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    nan = ((f16_bits & 0x7C00) == 0x7C00) & ((f16_bits & 0x03FF) != 0)
    f16_bits[nan] &= 0xFC00  # turn NaNs into infinities
    writer.add_tensor("bits.f16", f16_bits.view(np.float16))
    writer.add_tensor("quant.f16", values.astype(np.float16))
    # BF16: every bit pattern is fine (dequantisation is a shift).
    bf16_bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    writer.add_tensor("bits.bf16", bf16_bits.view(np.uint8).reshape(shape[0], -1),
                      raw_shape=shape, raw_dtype=Q.BF16)
    for qtype in QUANTIZABLE:
        q = gguf.quants.quantize(values, qtype)
        writer.add_tensor(f"quant.{qtype.name.lower()}", q, raw_dtype=qtype)
    block_shape = (32, 1024)  # 128 K-quant super-blocks, 1024 blocks of the 32-element types
    for qtype in BLOCK_SCALES:
        block_size, _ = GGML_QUANT_SIZES[qtype]
        n_blocks = block_shape[0] * block_shape[1] // block_size
        blocks = random_blocks(rng, qtype, n_blocks).reshape(block_shape[0], -1)
        writer.add_tensor(f"blocks.{qtype.name.lower()}", blocks, raw_dtype=qtype)
    # A 3-d tensor to exercise dims beyond rows x cols.
    writer.add_tensor("quant3d.q8_0", gguf.quants.quantize(
        (rng.standard_normal((2, 3, 64))).astype(np.float32), Q.Q8_0), raw_dtype=Q.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def reference_digests(path):
    reader = gguf.GGUFReader(path)
    out = {}
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        values = np.ascontiguousarray(values, dtype=np.float32)
        assert values.size == int(t.n_elements), t.name
        out[t.name] = (t.tensor_type.name.lower(), int(t.n_elements),
                       hashlib.sha256(values.tobytes()).hexdigest())
    return out


def kvr_digests(tool, path):
    proc = subprocess.run([tool, path, "--threads", "0"], capture_output=True, text=True)
    sys.stderr.write(proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{tool} failed with status {proc.returncode}")
    out = {}
    for line in proc.stdout.splitlines():
        name, type_name, n, digest = line.split("\t")
        out[name] = (type_name.lower(), int(n), digest)
    return out


def compare(tool, path):
    ref = reference_digests(path)
    got = kvr_digests(tool, path)
    bad = 0
    if set(ref) != set(got):
        print(f"tensor sets differ: only in gguf-py {sorted(set(ref) - set(got))}, "
              f"only in kvr {sorted(set(got) - set(ref))}")
        bad += 1
    types = {}
    for name in sorted(set(ref) & set(got)):
        types[ref[name][0]] = types.get(ref[name][0], 0) + 1
        if ref[name] != got[name]:
            print(f"MISMATCH {name}: gguf-py {ref[name]} kvr {got[name]}")
            bad += 1
    summary = ", ".join(f"{k}: {v}" for k, v in sorted(types.items()))
    print(f"{path}: {len(ref)} tensors compared ({summary}); {bad} mismatches")
    return bad == 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tool", required=True)
    ap.add_argument("--model")
    ap.add_argument("--synthetic", action="store_true")
    args = ap.parse_args()
    if args.synthetic:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "all_types.gguf")
            write_synthetic(path)
            return 0 if compare(args.tool, path) else 1
    if not args.model or not os.path.exists(args.model):
        print(f"model {args.model!r} not found; skipping")
        return 77
    return 0 if compare(args.tool, args.model) else 1


if __name__ == "__main__":
    sys.exit(main())
