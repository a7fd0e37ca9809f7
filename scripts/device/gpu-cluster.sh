#!/usr/bin/env bash
# The whole serving path on the GPU machine (issue 7): `kvr up --device cuda` (controller, KV
# store, a prefill node and a decode node running SmolLM2 on the GPU, the store reached over UCX
# shared memory on the same host), then `kvr generate` streams answers to a ~3000-token passkey
# prompt with quest and with clusterkv (one decode node per method: a CUDA decode node serves
# one method), and the nodes' metrics. Builds nothing there; the binaries and the non-system
# shared libraries they need (gRPC, protobuf, Abseil, UCX + its cma module, prometheus-cpp,
# OpenBLAS, ...) travel xz-compressed; the 94 MB GGUF travels in three parts (a call carries at
# most 64 MiB with the working tree), so three back-to-back calls (the warm machine keeps /tmp
# between them):
#   here:                                     bash scripts/device/gpu-cluster.sh bundle
#   call 1, carry [.device/gpucluster]:       bash scripts/device/gpu-cluster.sh stage
#   call 2, carry [.device/gpucluster-g2]:    bash scripts/device/gpu-cluster.sh part
#   call 3, carry [.device/gpucluster-g3]:    bash scripts/device/gpu-cluster.sh run
# Logs go to $OUT.
set -uo pipefail
. "$(dirname "$0")/lib.sh"  # bundle_bins, bundle_libs, pack_bundle
readonly kBundle=.device/gpucluster
readonly kStage=/tmp/kvr-gpucluster
readonly kModelSha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
readonly kPart1Bytes=28000000 kPart2Bytes=33000000
out="${OUT:-out}"
mkdir -p "$out"

case "${1:-}" in
  bundle)
    build="${BUILD_DIR:-build}"
    tmp=$(mktemp -d)
    mkdir -p "$tmp/bin" "$tmp/lib/ucx"
    for b in tools/kvr controller/kvr-controller kv-store/kvr-store prefill-node/kvr-prefill \
      decode-node/kvr-decode; do
      cp "$build/$b" "$tmp/bin/" && strip -g "$tmp/bin/$(basename "$b")" || exit 1
    done
    # UCX loads its transport modules from <libucs dir>/ucx: cma (cross-memory attach) for
    # shared memory between processes; posix/sysv shm and tcp are built into libuct.
    cp -L /usr/lib/x86_64-linux-gnu/ucx/libuct_cma.so.0 "$tmp/lib/ucx/"
    bundle_libs "$tmp/lib" "$tmp"/bin/* "$tmp"/lib/ucx/*
    rm -rf .device/gpucluster-g2 .device/gpucluster-g3
    mkdir -p .device/gpucluster-g2 .device/gpucluster-g3
    pack_bundle "$tmp" "$kBundle" || exit 1
    rm -rf "$tmp"
    model="${KVR_TEST_MODEL:-$HOME/.cache/kvr/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
    head -c "$kPart1Bytes" "$model" > "$kBundle/part00"
    tail -c +"$((kPart1Bytes + 1))" "$model" | head -c "$kPart2Bytes" > .device/gpucluster-g2/part01
    tail -c +"$((kPart1Bytes + kPart2Bytes + 1))" "$model" > .device/gpucluster-g3/part02
    du -sh "$kBundle" .device/gpucluster-g2 .device/gpucluster-g3
    ;;
  stage)
    rm -rf "$kStage" && mkdir -p "$kStage" && tar -C "$kStage" -xJf "$kBundle/bundle.tar.xz" || exit 1
    cp "$kBundle/part00" "$kStage/" || exit 1
    ls "$kStage/bin" && du -sh "$kStage"
    ;;
  part)
    [[ -f "$kStage/part00" ]] || { echo "no staged bundle: run 'stage' first (same warm machine)"; exit 1; }
    cp .device/gpucluster-g2/part01 "$kStage/" && ls -la "$kStage"
    ;;
  run)
    [[ -f "$kStage/part01" ]] || { echo "no staged parts: run 'stage' and 'part' first (same warm machine)"; exit 1; }
    cat "$kStage/part00" "$kStage/part01" .device/gpucluster-g3/part02 > "$kStage/smollm2.gguf" || exit 1
    echo "$kModelSha256  $kStage/smollm2.gguf" | sha256sum -c - || exit 1
    export LD_LIBRARY_PATH="$kStage/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    pkill -f "$kStage/bin/" 2>/dev/null; sleep 0.5  # an earlier call's cluster, if any
    status=0
    for method in quest clusterkv; do
      [[ $method == quest ]] && port=53051 || port=53151
      logs="$out/up-$method"
      mkdir -p "$logs"
      echo "== kvr up --device cuda (decode node: --gpu-method $method)"
      # Not through a pipe: the detached cluster keeps its stdout open.
      "$kStage/bin/kvr" up --model "$kStage/smollm2.gguf" --bin-dir "$kStage/bin" --device cuda \
        --decode-arg="--gpu-method=$method" --decode-arg=--gpu-n-sink=16 \
        --decode-arg=--gpu-local-window=256 --prefill 1 --decode 1 --base-port "$port" \
        --log-dir "$logs" --detach --pid-file "$logs/up.pid" --ready-timeout 120 \
        > "$logs/up.txt" 2>&1
      rc=$?
      tail -8 "$logs/up.txt"
      if [[ $rc -ne 0 ]]; then
        status=1
        tail -20 "$logs"/*.log
        continue
      fi
      "$kStage/bin/kvr" generate --endpoint "127.0.0.1:$port" --model smollm2 --chat --passkey 3000 \
        --passkey-seed 7 --max-tokens 48 --method "$method" --budget 256 --n-sink 16 \
        --local-window 256 2>&1 | tee "$logs/generate.txt"
      [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
      grep -h -E "on cuda|device|gpu_method|GPU|cuda:" "$logs"/prefill-0.log "$logs"/decode-0.log | head -6
      kill -TERM "$(cat "$logs/up.pid")" 2>/dev/null
      for _ in $(seq 1 100); do kill -0 "$(cat "$logs/up.pid")" 2>/dev/null || break; sleep 0.1; done
    done
    pkill -f "$kStage/bin/" 2>/dev/null
    echo "gpu-cluster: status $status"
    exit $status
    ;;
  *)
    echo "usage: $0 bundle|stage|part|run" >&2
    exit 2
    ;;
esac
