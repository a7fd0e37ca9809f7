#!/usr/bin/env bash
# Sparse decode on the CUDA model runtime and `kvr bench decode` on the device machine:
# the sparse parity tests (and the dense model tests, whose Forward the sparse path shares),
# compute-sanitizer memcheck on the sparse parity test, then `kvr bench decode`. Builds nothing
# there: `bundle` (here) copies the stripped binaries and the non-system shared libraries they
# need, xz-compressed, into .device/gpudecode/ (cuBLAS and the CUDA runtime are the device's own).
#
#   here:  bash scripts/device/gpu-decode.sh bundle
#   there: bash scripts/device/gpu-decode.sh run [bench flags...]   (device tool, carry
#          [".device/gpudecode"]; sparse tests, memcheck, then kvr bench decode --profile with
#          the flags; GPUDECODE_MODEL_TEST=1 adds the dense model tests, GPUDECODE_MEMCHECK=<gtest
#          filter> picks the memcheck subset, default *SmallBudget*)
#          bash scripts/device/gpu-decode.sh bench [bench flags...] (the bench alone)
#          GPUDECODE_STORE_GIB=N: a kvr-store process with an N GiB pool and a local socket runs
#          beside the bench, which gets --store (the "store" placement: rows read in place from
#          that process's pages, as a CUDA decode node reads them); GPUDECODE_STORE_RMA=1: the
#          store runs with --rma-reads and the bench gets --store-rma (the fetched rows and their
#          ceiling read by RMA gets from the store's pool)
#          GPUDECODE_TRACES=DIR at bundle: selection traces (kvr eval retrieval --trace-dir)
#          that the bench replays beside the synthetic selections (--replay; GPUDECODE_REPLAY=0
#          there: not)
#          GPUDECODE_MODEL=1 at bundle: SmolLM2's GGUF in three parts as well,
#          .device/gpudecode-m1, -m2 and -m3 (a call carries at most 64 MiB with the working
#          tree), put in place by back-to-back calls on the warm machine (it keeps /tmp for 30 s):
#            carry [".device/gpudecode", ".device/gpudecode-m1"]: ... gpu-decode.sh model-part
#            carry [".device/gpudecode-m2"]: bash scripts/device/gpu-decode.sh model-part
#            carry [".device/gpudecode-m3"]: bash scripts/device/gpu-decode.sh model-part &&
#              GPUDECODE_REAL=1 ... bench [flags]
#          GPUDECODE_REAL=1: the bench gets --model (the real SmolLM2, RoPE-scaled to the longest
#          context) and --text (the corpus the bundle always carries: Debian's GNU info
#          manuals), and no --replay
#          bash scripts/device/gpu-decode.sh ceil [bench flags...]  (compute-sanitizer memcheck of
#          the link probes (--ceiling-only, 16 MiB), the bench, GPUDECODE_PROBE_MIB="64 16384"
#          probes alone at those buffer sizes, then the sparse tests, each capped)
# Every mode first prints the host's NUMA layout and the GPU's place in it (the host KV's
# placement decides the gather's link rate: kvr bench decode --host-numa).
# Logs go to $OUT (or ./out/gpudecode).
set -uo pipefail
. "$(dirname "$0")/lib.sh"  # unpack_bundle
cd "$(dirname "$0")/../.."
readonly kBundle=.device/gpudecode
readonly kStage=/tmp/kvr-gpudecode
readonly kModelDir=/tmp/kvr-gpudecode-model  # survives `stage` (which empties kStage)
readonly kModelSha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
readonly kPart1Bytes=24000000 kPart2Bytes=50000000
out="${OUT:-out/gpudecode}"
mkdir -p "$out"

stage() {
  # The bundle carried with this call, else the copy model-part kept on this machine.
  local dir="$kBundle"
  [[ -f "$dir/bundle.tar.xz" ]] || dir="$kModelDir"
  unpack_bundle "$dir" "$kStage" || exit 1
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,pci.bus_id --format=csv,noheader
  free -g | head -2
  echo "numa nodes: $(cat /sys/devices/system/node/online 2>/dev/null)  cpus: $(nproc)" \
    "thp: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null)" \
    "libnuma: $(ldconfig -p 2>/dev/null | grep -c 'libnuma\.so')"
  for n in /sys/devices/system/node/node[0-9]*; do
    [[ -d $n ]] && echo "  $(basename "$n"): cpus $(cat "$n/cpulist")" \
      "$(awk '/MemTotal/{printf "mem %d GiB", $4/1048576}' "$n/meminfo")"
  done
  nvidia-smi topo -m 2>/dev/null | head -4
}

bench() {
  local store_args=() store_pid=
  if [[ -n "${GPUDECODE_STORE_GIB:-}" ]]; then
    # The store's memfd pool gets huge pages only from reserved hugetlb pages (shmem THP is
    # often off): reserve enough for the pool, and say what the kernel granted.
    sysctl -w vm.nr_hugepages=$(( GPUDECODE_STORE_GIB * 512 + 64 )) > /dev/null 2>&1
    echo "vm.nr_hugepages: $(cat /proc/sys/vm/nr_hugepages)"
    local rma_args=()
    [[ -n "${GPUDECODE_STORE_RMA:-}" ]] && rma_args=(--rma-reads true)
    "$kStage/bin/kvr-store" --listen 127.0.0.1:0 \
      --capacity-bytes "${GPUDECODE_STORE_GIB}GiB" --local-socket /tmp/kvr-bench-store.sock \
      "${rma_args[@]}" > "$out/store.log" 2>&1 &
    store_pid=$!
    for _ in $(seq 100); do
      grep -q 'kvr-store listening port=' "$out/store.log" && break
      sleep 0.2
    done
    local port
    port=$(sed -n 's/.*kvr-store listening port=\([0-9]*\).*/\1/p' "$out/store.log" | head -1)
    [[ -n "$port" ]] || { echo "kvr-store did not start:"; tail -5 "$out/store.log"; return 1; }
    grep -E 'page_backing|backing' "$out/store.log" | head -2
    store_args=(--store "127.0.0.1:$port")
    [[ -n "${GPUDECODE_STORE_RMA:-}" ]] && store_args+=(--store-rma)
  fi
  # The bundle's selection traces, replayed beside the synthetic selections (GPUDECODE_REPLAY=0:
  # not).
  local replay_args=() traces
  traces=$(ls "$kStage"/traces/*.kvrsel 2>/dev/null | paste -sd, -)
  [[ -n "$traces" && "${GPUDECODE_REPLAY:-1}" != 0 ]] && replay_args=(--replay "$traces")
  # GPUDECODE_REAL=1: the real SmolLM2 (both parts carried by earlier calls) over the corpus.
  if [[ -n "${GPUDECODE_REAL:-}" ]]; then
    [[ -f "$kModelDir/part00" && -f "$kModelDir/part01" && -f "$kModelDir/part02" ]] ||
      { echo "no model parts in $kModelDir: run model-part with each part first"; return 1; }
    cat "$kModelDir/part00" "$kModelDir/part01" "$kModelDir/part02" > "$kModelDir/smollm2.gguf" ||
      return 1
    echo "$kModelSha256  $kModelDir/smollm2.gguf" | sha256sum -c - || return 1
    replay_args=(--model "$kModelDir/smollm2.gguf" --text "$kStage/corpus/gnu-info.txt")
  fi
  # GPUDECODE_KVR: another kvr binary (e.g. an earlier build, to compare in one call).
  timeout 540 "${GPUDECODE_KVR:-$kStage/bin/kvr}" bench decode --profile \
    --json "$out/bench_decode.json" "${store_args[@]}" "${replay_args[@]}" "$@" 2>&1 |
    tee "$out/bench_decode.log"
  local rc=${PIPESTATUS[0]}
  [[ -n "$store_pid" ]] && kill "$store_pid" 2>/dev/null
  return "$rc"
}

case "${1:-}" in
  bundle)
    build="${BUILD_DIR:-build-gpudecode}"
    export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/kvr/ccache} CCACHE_BASEDIR=$PWD CCACHE_NOHASHDIR=1
    cmake --build "$build" --target retrieval_cuda_decode_test model_cuda_model_test kvr kvr-store \
      -j2 || exit 1
    rm -rf "$kBundle" && mkdir -p "$kBundle/bin" "$kBundle/lib"
    cp "$build/retrieval/retrieval_cuda_decode_test" "$build/model/model_cuda_model_test" \
      "$build/tools/kvr" "$build/kv-store/kvr-store" "$kBundle/bin/"
    strip -g "$kBundle"/bin/*
    # UCX loads its transport modules from <libucs dir>/ucx (cma: shared memory between
    # processes).
    mkdir -p "$kBundle/lib/ucx" && cp -L /usr/lib/x86_64-linux-gnu/ucx/libuct_cma.so.0 "$kBundle/lib/ucx/"
    ldd "$kBundle"/bin/* "$kBundle"/lib/ucx/* | awk '/=> \//{print $3}' |
      grep -v -E '/(libc|libm|libstdc\+\+|libgcc_s|ld-linux[^/]*|libpthread|libdl|librt|libcuda|libcudart|libcublas|libcublasLt)\.so' |
      sort -u | while read -r lib; do cp -L "$lib" "$kBundle/lib/"; done
    strip -g "$kBundle"/lib/*.so* 2>/dev/null
    # GPUDECODE_TRACES=DIR: selection traces (kvr eval retrieval --trace-dir) that the bench
    # replays (--replay); they compress ~40x.
    mkdir -p "$kBundle/traces"
    [[ -n "${GPUDECODE_TRACES:-}" ]] && cp "$GPUDECODE_TRACES"/*.kvrsel "$kBundle/traces/"
    # The real-model bench's corpus: Debian's GNU info manuals as plain text (~1.2M tokens).
    mkdir -p "$kBundle/corpus"
    for f in /usr/share/info/*.info*.gz; do zcat "$f"; done | tr -d '\000\037' \
      > "$kBundle/corpus/gnu-info.txt"
    tar -C "$kBundle" -cf - bin lib traces corpus | xz -T2 -6 > /tmp/gpudecode-bundle.tar.xz
    rm -rf "$kBundle" && mkdir -p "$kBundle" && mv /tmp/gpudecode-bundle.tar.xz "$kBundle/bundle.tar.xz"
    rm -rf .device/gpudecode-m1 .device/gpudecode-m2 .device/gpudecode-m3
    if [[ -n "${GPUDECODE_MODEL:-}" ]]; then
      model="${KVR_TEST_MODEL:-$HOME/.cache/kvr/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
      mkdir -p .device/gpudecode-m1 .device/gpudecode-m2 .device/gpudecode-m3
      head -c "$kPart1Bytes" "$model" > .device/gpudecode-m1/part00
      tail -c +"$((kPart1Bytes + 1))" "$model" | head -c "$kPart2Bytes" > .device/gpudecode-m2/part01
      tail -c +"$((kPart1Bytes + kPart2Bytes + 1))" "$model" > .device/gpudecode-m3/part02
      du -sh .device/gpudecode-m1 .device/gpudecode-m2 .device/gpudecode-m3
    fi
    du -sh "$kBundle"
    ;;
  model-part)  # whichever of the bundle and the model's parts this call carried
    mkdir -p "$kModelDir"
    for f in "$kBundle/bundle.tar.xz" .device/gpudecode-m1/part00 .device/gpudecode-m2/part01 \
      .device/gpudecode-m3/part02; do
      [[ -f "$f" ]] && cp "$f" "$kModelDir/"
    done
    ls -la "$kModelDir"
    ;;
  run)
    shift
    stage
    status=0
    "$kStage/bin/retrieval_cuda_decode_test" 2>&1 | tee "$out/sparse_test.log" |
      grep -E '^\[ *(OK|FAILED|PASSED|SKIPPED|parity|sparse) |Failure|error' || true
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
    # The dense model tests (the Forward the sparse path shares): GPUDECODE_MODEL_TEST=1.
    if [[ -n "${GPUDECODE_MODEL_TEST:-}" ]]; then
      "$kStage/bin/model_cuda_model_test" --gtest_filter=-*Gguf* 2>&1 | tee "$out/model_test.log" |
        grep -E '^\[ *(OK|FAILED|PASSED|SKIPPED) ' || true
      [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
    fi
    # memcheck: GPUDECODE_MEMCHECK (gtest filter) or the small-budget tests.
    if [[ -x /usr/local/cuda/bin/compute-sanitizer ]]; then
      timeout 150 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 3 \
        "$kStage/bin/retrieval_cuda_decode_test" \
        --gtest_filter="${GPUDECODE_MEMCHECK:-*SmallBudget*}" > "$out/sanitizer.log" 2>&1
      echo "compute-sanitizer memcheck (sparse test): rc $?  $(grep 'ERROR SUMMARY' "$out/sanitizer.log")"
    else
      echo "compute-sanitizer not found"
    fi
    bench "$@" || status=1
    echo "run: status $status"
    exit $status
    ;;
  bench)
    shift
    stage
    bench "$@"
    ;;
  ceil)
    shift
    stage
    status=0
    if [[ -x /usr/local/cuda/bin/compute-sanitizer ]]; then
      timeout 60 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 3 \
        "$kStage/bin/kvr" bench decode --ceiling-only --ceiling-mib 16 --ceiling-repeats 1 \
        --host-numa gpu,far,unbound,thp > "$out/sanitizer_probes.log" 2>&1
      echo "compute-sanitizer memcheck (link probes): rc $?" \
        "$(grep 'ERROR SUMMARY' "$out/sanitizer_probes.log")"
    fi
    bench "$@" || status=1
    # GPUDECODE_PROBE_MIB="64 16384": the link probes alone at other buffer sizes (the scattered
    # row reads depend on the footprint), placements GPUDECODE_PROBE_NUMA (default gpu,far,thp).
    for mib in ${GPUDECODE_PROBE_MIB:-}; do
      timeout 120 "$kStage/bin/kvr" bench decode --ceiling-only --ceiling-mib "$mib" \
        --host-numa "${GPUDECODE_PROBE_NUMA:-gpu,far,thp}" 2>&1 | tee "$out/probes_${mib}mib.log" |
        grep -E '^  [a-z0-9]'
    done
    timeout "${GPUDECODE_TEST_TIMEOUT:-120}" "$kStage/bin/retrieval_cuda_decode_test" 2>&1 |
      tee "$out/sparse_test.log" | grep -E '^\[ *(OK|FAILED|PASSED|SKIPPED) |Failure' || true
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
    echo "ceil: status $status"
    exit $status
    ;;
  *)
    echo "usage: $0 bundle|run|bench|ceil [kvr bench decode flags]" >&2
    exit 2
    ;;
esac
