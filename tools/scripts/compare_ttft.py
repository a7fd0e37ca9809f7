#!/usr/bin/env python3
"""Pools the TTFTs of several `kvr bench --result-file` JSONs per group and prints each group's
p50 / mean / p90 and each group's p50 minus the first group's, e.g. the HTTP front door's
overhead over gRPC from interleaved runs on one cluster. Where a kvr server reported its own
TTFT (server_ttfts), also the p50 of client TTFT minus server TTFT per request: what the client,
the wire and the front door added, without the prefill's run-to-run noise:

    compare_ttft.py grpc='runs/grpc-*.json' http='runs/http-*.json'

Failed requests (TTFT 0 in the JSON) are left out and counted. Standard library only."""
import glob
import json
import statistics
import sys

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
from percentile import percentile  # noqa: E402


def main(argv):
    if not argv or any("=" not in a for a in argv):
        print(__doc__, file=sys.stderr)
        return 2
    rows = []
    for arg in argv:
        name, pattern = arg.split("=", 1)
        files = sorted(glob.glob(pattern))
        if not files:
            print(f"{name}: no file matches {pattern}", file=sys.stderr)
            return 2
        ttfts, added, failed = [], [], 0
        for path in files:
            with open(path) as f:
                j = json.load(f)
            failed += j["failed"]
            server = j.get("server_ttfts") or [None] * len(j["ttfts"])
            for t, s, e in zip(j["ttfts"], server, j["errors"]):
                if e:
                    continue
                ttfts.append(t * 1000.0)
                if s is not None:
                    added.append((t - s) * 1000.0)
        ttfts.sort()
        added.sort()
        rows.append((name, len(files), len(ttfts), failed, percentile(ttfts, 50),
                     statistics.fmean(ttfts) if ttfts else 0.0, percentile(ttfts, 90),
                     percentile(added, 50) if added else None))
    base, base_added = rows[0][4], rows[0][7]
    print("| group | runs | requests | failed | TTFT p50 ms | mean ms | p90 ms | p50 - "
          f"{rows[0][0]} ms | client - server TTFT p50 ms | that - {rows[0][0]} ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, runs, n, failed, p50, mean, p90, added in rows:
        extra = ("n/a | n/a" if added is None or base_added is None
                 else f"{added:.2f} | {added - base_added:+.2f}")
        print(f"| {name} | {runs} | {n} | {failed} | {p50:.2f} | {mean:.2f} | {p90:.2f} | "
              f"{p50 - base:+.2f} | {extra} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
