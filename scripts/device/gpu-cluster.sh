#!/usr/bin/env bash
# The whole serving path on the GPU machine: `kvr up --device cuda` (controller, KV
# store, a prefill node and a decode node running SmolLM2 on the GPU, the store reached over UCX
# shared memory on the same host), then `kvr generate` streams answers to a ~3000-token passkey
# prompt with every method: a CUDA decode node selects its gpu_method (quest or clusterkv) on
# the GPU and every other method on the host with the method's CPU index (pariskv in a GPU lane),
# in the same batch (and `full`, and sequences of at most gpu_dense_max_tokens, densely). Builds nothing there; the binaries and the non-system
# shared libraries they need (gRPC, protobuf, Abseil, UCX + its cma module, prometheus-cpp,
# OpenBLAS, ...) travel xz-compressed; the 94 MB GGUF travels in three parts (a call carries at
# most 64 MiB with the working tree), so three back-to-back calls (the warm machine keeps /tmp
# between them):
#   here:                                     bash scripts/device/gpu-cluster.sh bundle
#   call 1, carry [.device/gpucluster]:       bash scripts/device/gpu-cluster.sh stage
#   call 2, carry [.device/gpucluster-g2]:    bash scripts/device/gpu-cluster.sh part
#   optional, carry [.device/gpucluster-cb]:  bash scripts/device/gpu-cluster.sh codebooks
#   call 3, carry [.device/gpucluster-g3]:    bash scripts/device/gpu-cluster.sh run
# run: per GPU method (a cluster each), passkey prompts of ~1000 and ~3000 tokens; after each,
# the decode node's private resident memory (RssAnon) and its mappings of the store's shared
# pool (RssShmem): the decode node reads the store's pages in place, so its own memory must not
# follow the prompt. On the quest cluster then a new ~7000-token prompt twice (the first
# computed cold and cached, the second reusing the cached prefix: TTFT of each), and every other
# method at ~3000 tokens (exact, pariskv, keydiff, ctkvr and, with codebooks, a2ats in
# GPU lanes, the rest selected on the host; a2ats with codebooks from `kvr calibrate`:
# bundle with GPUCLUSTER_CODEBOOKS=FILE), `full` at ~1000 tokens, and `full` at ~3000 tokens
# refused (its rows exceed gpu_budget, 1024).
# GPUCLUSTER_GPUS=2 (device kind nvidia-h100-x2): the prefill node on GPU 0 and the
# decode node on GPU 1, then both on GPU 0 for comparison (quest), TTFT and decode tok/s each.
# GPUCLUSTER_ROW_SOURCE=fetch: the decode node fetches the rows it misses through the store's
# data plane (UCX; --gpu-row-source fetch, what a store on another host gets) instead of reading
# the store's pages in place: the quest cluster only, every method at ~3000 tokens and the
# decode node's memory at ~1000 and ~3000.
# GPUCLUSTER_STORE_RMA=1 (with fetch): the store runs with --rma-reads and the decode node with
# --store-rma-reads, so the misses are RMA gets from the store's pool.
# Logs go to $OUT.
set -uo pipefail
. "$(dirname "$0")/lib.sh"  # bundle_bins, bundle_libs, pack_bundle, unpack_bundle*, use_stage_libs
readonly kBundle=.device/gpucluster
readonly kStage=/tmp/kvr-gpucluster
readonly kModelSha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
readonly kPart1Bytes=20000000 kPart2Bytes=36000000
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
    rm -rf .device/gpucluster-cb
    if [[ -n "${GPUCLUSTER_CODEBOOKS:-}" ]]; then
      mkdir -p .device/gpucluster-cb && cp "$GPUCLUSTER_CODEBOOKS" .device/gpucluster-cb/smollm2.kvrcb
    fi
    du -sh "$kBundle" .device/gpucluster-g2 .device/gpucluster-g3
    ;;
  stage)
    unpack_bundle "$kBundle" "$kStage" || exit 1
    cp "$kBundle/part00" "$kStage/" || exit 1
    ls "$kStage/bin" && du -sh "$kStage"
    ;;
  part)
    [[ -f "$kStage/part00" ]] || { echo "no staged bundle: run 'stage' first (same warm machine)"; exit 1; }
    cp .device/gpucluster-g2/part01 "$kStage/" && ls -la "$kStage"
    ;;
  codebooks)  # optional, between part and run: a2ats codebooks (bundle's GPUCLUSTER_CODEBOOKS)
    cp .device/gpucluster-cb/smollm2.kvrcb "$kStage/" && ls -la "$kStage/smollm2.kvrcb"
    ;;
  run)
    [[ -f "$kStage/part01" ]] || { echo "no staged parts: run 'stage' and 'part' first (same warm machine)"; exit 1; }
    cat "$kStage/part00" "$kStage/part01" .device/gpucluster-g3/part02 > "$kStage/smollm2.gguf" || exit 1
    echo "$kModelSha256  $kStage/smollm2.gguf" | sha256sum -c - || exit 1
    use_stage_libs "$kStage"
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    pkill -f "$kStage/bin/" 2>/dev/null; sleep 0.5  # an earlier call's cluster, if any
    status=0
    memory() {  # the decode node's memory: private and the store pool it maps
      local pid
      pid=$(pgrep -f "$kStage/bin/kvr-decode" | head -1)
      [[ -n "$pid" ]] && awk '/^(RssAnon|RssShmem|VmLck|VmPin):/{printf "%s %s %s  ", $1, $2, $3}' \
        "/proc/$pid/status" && echo
    }
    codebooks=()
    lanes=exact,pariskv,keydiff,ctkvr
    if [[ -f "$kStage/smollm2.kvrcb" ]]; then
      codebooks=(--a2ats-codebooks "$kStage/smollm2.kvrcb")
      lanes+=,a2ats
    fi
    # up NAME PORT PREFILL_GPU DECODE_GPU METHOD [BUDGET]: a cluster, detached; non-zero if it
    # failed.
    up() {
      local logs="$out/up-$1" rma=()
      [[ -n "${GPUCLUSTER_STORE_RMA:-}" ]] &&
        rma=(--store-arg=--rma-reads=true --decode-arg=--store-rma-reads=true)
      mkdir -p "$logs"
      echo "== $1: kvr up --device cuda (prefill cuda:$3, decode cuda:$4, --gpu-method $5)"
      # Not through a pipe: the detached cluster keeps its stdout open.
      "$kStage/bin/kvr" up --model "$kStage/smollm2.gguf" --bin-dir "$kStage/bin" --device cuda \
        --prefill-arg="--cuda-device=$3" --decode-arg="--cuda-device=$4" \
        --decode-arg="--gpu-method=$5" --decode-arg=--gpu-n-sink=16 \
        --decode-arg=--gpu-local-window=256 --decode-arg="--gpu-budget=${6:-1024}" \
        --decode-arg="--gpu-lanes=$lanes" \
        --decode-arg="--gpu-row-source=${GPUCLUSTER_ROW_SOURCE:-in-place}" \
        "${rma[@]}" "${codebooks[@]}" --prefill 1 --decode 1 --base-port "$2" \
        --log-dir "$logs" --detach --pid-file "$logs/up.pid" --ready-timeout 120 \
        > "$logs/up.txt" 2>&1
      local rc=$?
      tail -4 "$logs/up.txt"
      [[ $rc -eq 0 ]] || { tail -20 "$logs"/*.log; return 1; }
    }
    down() {  # stops the cluster (every process of the stage: kvr up and its children)
      pkill -TERM -f "$kStage/bin/" 2>/dev/null
      for _ in $(seq 1 100); do pgrep -f "$kStage/bin/" > /dev/null || break; sleep 0.1; done
    }
    generate() {  # PORT METHOD PASSKEY_TOKENS LOGFILE [PASSKEY_SEED]
      # The cluster's CA is in its log directory, where the output file goes.
      "$kStage/bin/kvr" generate --endpoint "127.0.0.1:$1" --tls-ca "$(dirname "$4")/tls/ca.pem" \
        --model smollm2 --chat --passkey "$3" \
        --passkey-seed "${5:-7}" --max-tokens 48 --method "$2" --budget 256 --n-sink 16 \
        --local-window 256 2>&1 | tee "$4"
      return "${PIPESTATUS[0]}"
    }
    if [[ "${GPUCLUSTER_GPUS:-1}" == 2 ]]; then
      for setup in "two-gpus 53051 0 1" "one-gpu 53151 0 0"; do
        read -r name port pg dg <<< "$setup"
        up "$name" "$port" "$pg" "$dg" quest || { status=1; continue; }
        for i in 1 2 3; do
          generate "$port" quest 3000 "$out/up-$name/generate$i.txt" > /dev/null || status=1
          grep -E '^(prompt|decode):' "$out/up-$name/generate$i.txt"
        done
        down "$name"
      done
    else
      methods="quest clusterkv"
      [[ "${GPUCLUSTER_ROW_SOURCE:-in-place}" == fetch ]] && methods=quest
      for method in $methods; do
        [[ $method == quest ]] && port=53051 || port=53151
        up "$method" "$port" 0 0 "$method" || { status=1; continue; }
        for tokens in 1000 3000; do
          echo "-- passkey prompt of ~$tokens tokens"
          generate "$port" "$method" "$tokens" "$out/up-$method/generate-$tokens.txt" || status=1
          echo -n "decode node memory after it: "
          memory
        done
        grep -h -E "on cuda|device|gpu_method|GPU|cuda:|local pool|mapped" \
          "$out/up-$method"/prefill-0.log "$out/up-$method"/decode-0.log | head -8
        if [[ $method == quest ]]; then
          # Prefix reuse through the whole GPU cluster: a ~7000-token prompt not seen yet (its
          # first words are this run's own), then the same again (the controller's prefix cache
          # matches it; the prefill node forks the cached rows and computes only what follows
          # them), TTFT cold vs reused.
          prompt_file="$out/up-$method/prefix-prompt.txt"
          {
            echo "Run $(date +%s%N) notes."
            for i in $(seq 1 360); do
              echo "Line $i: the store keeps every row and the decode node pulls only a few."
            done
            echo "Which line number comes after line 17?"
          } > "$prompt_file"
          for turn in cold reused; do
            "$kStage/bin/kvr" generate --endpoint "127.0.0.1:$port" \
              --tls-ca "$out/up-$method/tls/ca.pem" --model smollm2 --prompt-file "$prompt_file" \
              --max-tokens 8 --method quest --budget 256 --n-sink 16 \
              --local-window 256 > "$out/up-$method/generate-prefix-$turn.txt" 2>&1 || status=1
            echo "-- a long prompt of this run's own, $turn: $(grep -E '^prompt:' "$out/up-$method/generate-prefix-$turn.txt")"
          done
          methods_here="exact streaming clusterkv ctkvr pariskv keydiff"
          [[ ${#codebooks[@]} -gt 0 ]] && methods_here+=" a2ats"  # a2ats needs codebooks
          for m in $methods_here; do
            echo "-- $m (on the quest node: GPU lanes for ${lanes//,/, }, else host-selected), ~3000 tokens"
            generate "$port" "$m" 3000 "$out/up-$method/generate-$m.txt" || status=1
          done
          echo "-- full at ~1000 tokens (runs densely: its KV in HBM, gpu_dense_bytes)"
          generate "$port" full 1000 "$out/up-$method/generate-full.txt" || status=1
          echo "-- full at ~3000 tokens (runs densely too, though its rows exceed gpu_budget 1024)"
          generate "$port" full 3000 "$out/up-$method/generate-full-3000.txt" || status=1
        fi
        down "$method"
      done
    fi
    pkill -f "$kStage/bin/" 2>/dev/null
    echo "gpu-cluster: status $status"
    exit $status
    ;;
  *)
    echo "usage: $0 bundle|stage|part|run" >&2
    exit 2
    ;;
esac
