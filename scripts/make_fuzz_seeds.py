#!/usr/bin/env python3
"""Writes the seed corpora of the libFuzzer targets (kvr_add_fuzzer) into the source tree:
small valid inputs of each format, so that fuzzing starts from the accepted paths rather than
from random bytes. Standard library only; run again after a format changes.

  model/fuzz/corpus/gguf/        GGUF v3 files: metadata of each value type, f32/f16/q8_0 tensors
  model/fuzz/corpus/tokenizer/   mode byte + text (see tokenizer_fuzz.cc)
  kv-store/fuzz/corpus/wire/     type byte + header length + header + payload (wire_fuzz.cc)
  kv-store/fuzz/corpus/store_service/  scripts of serialized store requests
  controller/fuzz/corpus/generate_request/  serialized kvr.v1.GenerateRequest
"""
import os
import struct
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write(folder, name, data):
    path = os.path.join(ROOT, folder, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


# ---- protobuf wire encoding (enough for these messages)
def varint(v):
    out = b""
    v &= (1 << 64) - 1
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def f_varint(field, v):
    return varint(field << 3) + varint(v)


def f_bytes(field, b):
    if isinstance(b, str):
        b = b.encode()
    return varint((field << 3) | 2) + varint(len(b)) + b


def f_float(field, x):
    return varint((field << 3) | 5) + struct.pack("<f", x)


# ---- GGUF
def gguf_string(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def gguf(metadata, tensors, alignment=32):
    """metadata: [(key, type, payload bytes)]; tensors: [(name, dims, ggml type, data)]."""
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata))
    for key, vtype, payload in metadata:
        out += gguf_string(key) + struct.pack("<I", vtype) + payload
    offset = 0
    datas = b""
    for name, dims, gtype, data in tensors:
        out += gguf_string(name) + struct.pack("<I", len(dims))
        out += b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", gtype, offset)
        pad = (-len(data)) % alignment
        datas += data + b"\0" * pad
        offset += len(data) + pad
    out += b"\0" * ((-len(out)) % alignment)
    return out + datas


def gguf_seeds():
    U32, I32, F32, BOOL, STR, ARR = 4, 5, 6, 7, 8, 9
    meta = [
        ("general.architecture", STR, gguf_string("llama")),
        ("general.alignment", U32, struct.pack("<I", 32)),
        ("llama.context_length", U32, struct.pack("<I", 2048)),
        ("llama.rope.freq_base", F32, struct.pack("<f", 10000.0)),
        ("tokenizer.ggml.add_bos_token", BOOL, b"\x01"),
        ("tokenizer.ggml.bos_token_id", I32, struct.pack("<i", 1)),
        ("tokenizer.ggml.tokens", ARR,
         struct.pack("<IQ", STR, 3) + gguf_string("a") + gguf_string("b") + gguf_string("ab")),
        ("tokenizer.ggml.token_type", ARR, struct.pack("<IQ", I32, 3) + struct.pack("<3i", 1, 1, 1)),
    ]
    f32 = struct.pack("<8f", *[i * 0.5 for i in range(8)])
    f16 = struct.pack("<8e", *[i * 0.25 for i in range(8)])
    q8_0 = struct.pack("<e", 0.1) + bytes(range(32))  # one block of 32
    tensors = [("w.f32", [4, 2], 0, f32), ("w.f16", [8], 1, f16), ("w.q8_0", [32], 8, q8_0)]
    write("model/fuzz/corpus/gguf", "llama_small.gguf", gguf(meta, tensors))
    write("model/fuzz/corpus/gguf", "metadata_only.gguf", gguf(meta[:3], []))


def tokenizer_seeds():
    d = "model/fuzz/corpus/tokenizer"
    write(d, "text", b"\x00The theater is in the center, isn't it? 123 + 4567")
    write(d, "unicode", b"\x00caf\xc3\xa9 \xe4\xb8\xad\xe6\x96\x87 \xf0\x9f\x98\x80\n\ttabs  ")
    write(d, "special", b"\x01<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")
    write(d, "ids", b"\x02" + bytes(range(64)))
    write(d, "ids_signed", b"\x0a" + bytes([0xFF, 0x7F, 0x00, 0x80, 0x10, 0x01]))
    write(d, "chat", b"\x07be brief\x01what is 2+2?\x01four")


# ---- kv-store wire (kv-store/include/kvr/kv_store/wire.h)
MAGIC, VERSION = 0x5352564B, 2
CAP = bytes(range(1, 17))


def wire_header(mtype, deadline_us=0):
    return struct.pack("<IHHq", MAGIC, VERSION, mtype, deadline_us)


def wire_seeds():
    d = "kv-store/fuzz/corpus/wire"

    def case(type_byte, header, payload):
        return bytes([type_byte, len(header)]) + header + payload

    write_hdr = wire_header(1) + struct.pack("<QQII", 7, 0, 0, 2) + CAP
    write(d, "write", case(0, write_hdr, bytes(2 * 2 * 2 * 16 * 2)))
    idx = struct.pack("<3I", 0, 5, 2)
    entries = struct.pack("<QIIII", 7, 0, 1, 3, 0) + CAP + struct.pack("<QIIII", 8, 1, 0, 0, 0) + CAP
    write(d, "gather", case(1, wire_header(2) + struct.pack("<IIQ", 2, 0, 3), entries + idx))
    rng = struct.pack("<QIIQQ", 7, 0, 1, 4, 16) + CAP
    write(d, "range", case(2, wire_header(3) + struct.pack("<II", 1, 0), rng))
    write(d, "locate", case(3, wire_header(4) + struct.pack("<II", 1, 0), rng))
    write(d, "reply", case(4 + 5, struct.pack("<IHHQQ", MAGIC, VERSION, 2, 96, 0), b""))
    write(d, "deadline_past", case(1, wire_header(2, 1) + struct.pack("<IIQ", 0, 0, 0), b""))


def store_service_seeds():
    d = "kv-store/fuzz/corpus/store_service"
    cap = CAP

    def call(method, body):
        return bytes([method]) + struct.pack("<H", len(body)) + body

    shape = f_varint(1, 2) + f_varint(2, 2) + f_varint(3, 16) + f_varint(4, 3)
    create = f_varint(1, 7) + f_bytes(2, shape) + f_varint(3, 64) + f_varint(4, 60000) + f_bytes(5, cap)
    rows = bytes(2 * 2 * 16 * 2)  # 2 rows x 2 heads x 16 dims x bf16
    append = f_varint(1, 7) + f_varint(2, 0) + f_varint(5, 2) + f_bytes(6, rows) + f_bytes(7, rows) + f_bytes(8, cap)
    append_end = f_varint(1, 7) + f_varint(2, 1) + f_varint(4, 1) + f_varint(5, 2) + f_bytes(6, rows) + f_bytes(7, rows) + f_bytes(8, cap)
    get = f_varint(1, 7) + f_bytes(2, cap)
    lease = f_varint(1, 7) + f_varint(2, 1000) + f_bytes(3, cap)
    reserve = f_varint(1, 7) + f_varint(2, 40) + f_bytes(3, cap)
    release = f_varint(1, 7) + f_bytes(3, cap)
    write(d, "lifecycle", call(0, create) + call(1, append) + call(1, append_end) + call(4, get)
          + call(3, lease) + call(7, reserve) + call(5, b"") + call(6, b"") + call(2, release))
    wrong = f_varint(1, 7) + f_bytes(2, bytes(16))
    write(d, "wrong_capability", call(0, create) + call(4, wrong) + call(2, f_varint(1, 7)))
    huge = f_varint(1, 9) + f_bytes(2, f_varint(1, 0xFFFFFFFF) + f_varint(2, 0xFFFFFFFF) + f_varint(3, 0xFFFFFFFF) + f_varint(4, 1)) + f_varint(3, (1 << 64) - 1) + f_bytes(5, cap)
    write(d, "huge_shape", call(0, huge))


def generate_request_seeds():
    d = "controller/fuzz/corpus/generate_request"
    sampling = f_varint(1, 16) + f_float(2, 0.7) + f_float(3, 0.9) + f_varint(4, 40) + f_varint(5, 42) + f_bytes(6, "\n\n") + f_varint(7, 1)
    retrieval = f_bytes(1, "clusterkv") + f_varint(2, 256) + f_varint(3, 16) + f_varint(4, 128) + f_bytes(5, f_bytes(1, "k") + f_bytes(2, "v"))
    write(d, "text", f_bytes(1, "smollm2") + f_bytes(2, "Hello there") + f_bytes(5, sampling) + f_bytes(6, retrieval) + f_bytes(7, "req-1"))
    ids = f_bytes(1, b"".join(varint(i) for i in (1, 2, 3, 4000, 49151)))
    write(d, "token_ids", f_bytes(1, "smollm2") + f_bytes(3, ids) + f_bytes(5, f_varint(1, 8)))
    chat = f_bytes(1, f_bytes(1, "system") + f_bytes(2, "be brief")) + f_bytes(1, f_bytes(1, "user") + f_bytes(2, "hi"))
    write(d, "chat", f_bytes(1, "smollm2") + f_bytes(4, chat) + f_bytes(8, f_varint(3, 1)))
    write(d, "limits", f_bytes(1, "smollm2") + f_bytes(2, "x") + f_bytes(6, f_varint(3, 0xFFFFFFFF) + f_varint(4, 0xFFFFFFFF)))


if __name__ == "__main__":
    gguf_seeds()
    tokenizer_seeds()
    wire_seeds()
    store_service_seeds()
    generate_request_seeds()
    sys.exit(0)
