#!/usr/bin/env python3
"""Fails when a component includes a header of a component above it (docs/conventions.md).

Layers point down only: common and proto <- model <- retrieval <- transport <- kv-store <- node
(the node library: membership) <- controller, prefill-node, decode-node and the kvr-store binary
(kv-store/tools/) <- tools <- tests. A file's component is the longest folder of RANK its path
starts with; an included header's component is named by its path under kvr/ (kvr/kv_store/...,
generated protos kvr/v1, kvr/store, kvr/cluster). Components of one rank may not include each
other.

Known debts are listed in ALLOWED with the reason; anything else above the includer fails, and
so does an ALLOWED entry that no file needs any more (the debt was paid: delete the entry).

Usage: check_layers.py [ROOT]   (default: the repository this script is in). Exit 0 when the
tree holds the layering, 1 with one line per offending include otherwise.
"""
import pathlib
import re
import sys

# Folder -> rank; a file may include its own component and components of a lower rank. A
# nested folder (kv-store/tools) is a component of its own: the kvr-store binary sits beside
# the other nodes, above the node library, while the store library under it stays below.
RANK = {
    "common": 0, "proto": 0,
    "model": 1,
    "retrieval": 2,
    "transport": 3,
    "kv-store": 4,
    "node": 5,
    "controller": 6, "prefill-node": 6, "decode-node": 6, "kv-store/tools": 6,
    "tools": 7,
    "tests": 8,
}
# Header namespace (kvr/<name>/) -> folder.
NAMESPACE = {
    "common": "common", "v1": "proto", "store": "proto", "cluster": "proto",
    "model": "model", "retrieval": "retrieval", "transport": "transport",
    "kv_store": "kv-store", "node": "node", "controller": "controller",
    "prefill_node": "prefill-node", "decode": "decode-node", "loadgen": "tools",
}
# (including folder, included folder, path prefix of the including files): why it is allowed.
ALLOWED = {
    ("model", "retrieval", "model/cuda/cuda_model.cu"):
        "CudaModel still builds the prefill summaries (SetPrefillSummaries) with retrieval's GPU "
        "build kernels; they move behind a per-layer build hook that the prefill node supplies "
        "(the sparse decode already left: retrieval/cuda/decode, a CudaAttention hook)",
}
INCLUDE = re.compile(r'^\s*#\s*include\s+"kvr/([a-z_0-9]+)/')
SOURCES = ("*.h", "*.cc", "*.cu", "*.cuh")


def component(rel):
    """The component of the file at `rel` (a path relative to the root): the longest folder of
    RANK that holds it."""
    best = None
    for folder in RANK:
        if rel.startswith(folder + "/") and (best is None or len(folder) > len(best)):
            best = folder
    return best


def sources(root):
    seen = set()
    for top in sorted({f.split("/")[0] for f in RANK}):
        base = root / top
        if not base.is_dir():
            continue
        for pattern in SOURCES:
            for path in sorted(base.rglob(pattern)):
                if path not in seen:
                    seen.add(path)
                    yield path


def check(root):
    errors, used = [], set()
    for path in sources(root):
        rel = path.relative_to(root).as_posix()
        folder = component(rel)
        rank = RANK[folder]
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            m = INCLUDE.match(line)
            if not m or m.group(1) not in NAMESPACE:
                continue
            target = NAMESPACE[m.group(1)]
            if RANK[target] <= rank and (target == folder or RANK[target] < rank):
                continue
            allowed = [k for k in ALLOWED
                       if k[0] == folder and k[1] == target and rel.startswith(k[2])]
            if allowed:
                used.update(allowed)
                continue
            errors.append(f"{rel}:{n}: {folder} (layer {rank}) includes {target} "
                          f"(layer {RANK[target]}): {line.strip()}")
    for key in sorted(set(ALLOWED) - used):
        errors.append(f"ALLOWED entry {key} is no longer needed: remove it from {__file__}")
    return errors


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parent.parent)
    errors = check(root.resolve())
    for e in errors:
        print(e)
    if errors:
        print(f"check_layers: {len(errors)} include(s) against the layering (docs/conventions.md, 'Layers point down only')")
        return 1
    print("check_layers: every include points down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
