# shellcheck shell=bash
# Shared by the device scripts' `bundle` steps and, for unpacking a bundle, their device-side
# steps (source it: . "$(dirname "$0")/lib.sh"). Binaries
# are built here and run on the device machine (Ubuntu 24.04 with CUDA, without the Debian
# libraries the build links), so a bundle carries them with the shared libraries they need,
# xz-compressed (OpenBLAS and ICU's data alone are tens of MB).

# bundle_libs LIBDIR FILE...: copies into LIBDIR, stripped of debug info, every shared library
# that FILE... load and that the device lacks (glibc, libstdc++, libgcc_s, the CUDA driver and
# runtime and cuBLAS are there). Files that are not dynamic executables are ignored.
bundle_libs() {
  local libdir=$1
  shift
  mkdir -p "$libdir" || return 1
  ldd "$@" 2>/dev/null | awk '/=> \//{print $3}' |
    grep -v -E '/(libc|libm|libstdc\+\+|libgcc_s|ld-linux[^/]*|libpthread|libdl|librt|libcuda|libcudart|libcublas|libcublasLt)\.so' |
    sort -u | while read -r lib; do cp -L "$lib" "$libdir/"; done
  strip -g "$libdir"/*.so* 2>/dev/null
  return 0
}

# pack_bundle SRC DIR: DIR (emptied first) then holds only bundle.tar.xz, SRC's contents, which
# the device unpacks with tar -C <stage> -xJf DIR/bundle.tar.xz.
pack_bundle() {
  rm -rf "$2" && mkdir -p "$2" && tar -C "$1" -cf - . | xz -T2 -6 > "$2/bundle.tar.xz"
}

# use_stage_libs STAGE: LD_LIBRARY_PATH leads with STAGE/lib (a bundle's libraries) and the
# CUDA runtime's folder, for the staged binaries.
use_stage_libs() {
  export LD_LIBRARY_PATH="$1/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
}

# unpack_bundle DIR STAGE: on the device, STAGE (emptied first) holds the contents of
# DIR/bundle.tar.xz (pack_bundle's), then use_stage_libs STAGE. Non-zero when it cannot be
# unpacked.
unpack_bundle() {
  rm -rf "$2" && mkdir -p "$2" && tar -C "$2" -xJf "$1/bundle.tar.xz" || return 1
  use_stage_libs "$2"
}

# unpack_bundle_once DIR STAGE FILE: unpack_bundle, but a STAGE that already holds the
# executable STAGE/FILE (an earlier call on the same machine) is used as it is, not emptied.
unpack_bundle_once() {
  if [[ ! -x $2/$3 ]]; then
    mkdir -p "$2" && tar -C "$2" -xJf "$1/bundle.tar.xz" || return 1
  fi
  use_stage_libs "$2"
}

# bundle_bins DIR FILE...: pack_bundle of bin/ (FILE..., stripped of debug info) and lib/
# (bundle_libs of them) into DIR. Non-zero, DIR untouched, when a FILE is missing.
bundle_bins() {
  local dir=$1 tmp rc
  shift
  tmp=$(mktemp -d) || return 1
  mkdir -p "$tmp/bin"
  if ! cp "$@" "$tmp/bin/"; then
    rm -rf "$tmp"
    return 1
  fi
  strip -g "$tmp"/bin/* 2>/dev/null
  bundle_libs "$tmp/lib" "$tmp"/bin/*
  pack_bundle "$tmp" "$dir"
  rc=$?
  rm -rf "$tmp"
  return $rc
}

# build_targets BUILD TARGET...: configures BUILD (RelWithDebInfo; CUDA as CMake finds it) unless
# it holds a build already, then builds TARGET... there. Run from the repository root.
build_targets() {
  local build=$1
  shift
  export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/kvr/ccache}
  [[ -f $build/build.ninja ]] ||
    cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build "$build" --target "$@" -j2
}

# stage_targets BUILD DIR TARGET...: DIR (emptied first) holds each TARGET's executable found
# under BUILD, stripped of debug info, and DIR/lib every shared library they load but glibc's
# and the CUDA driver's (the device is Ubuntu 24.04 without Debian's absl / openblas builds),
# also stripped (more than bundle_libs copies: libstdc++, libgcc_s and the CUDA runtime go too).
stage_targets() {
  local build=$1 dir=$2 t b
  shift 2
  rm -rf "$dir" && mkdir -p "$dir/lib"
  local bins=()
  for t in "$@"; do
    b=$(find "$build" -type f -name "$t" -perm -u+x | head -1)
    cp "$b" "$dir/" && strip -g "$dir/$t" && bins+=("$dir/$t")
  done
  ldd "${bins[@]}" | awk '/=> \//{print $3}' | sort -u |
    grep -Ev '/(libc|libm|libdl|librt|libpthread|ld-linux-x86-64|libcuda)\.so' |
    while read -r lib; do cp -L "$lib" "$dir/lib/"; done
  strip -g "$dir"/lib/*.so* 2>/dev/null || true
}

# compute_sanitizer: the path of compute-sanitizer (on PATH, else CUDA's default place).
compute_sanitizer() {
  command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer
}

# dispatch_bundle_run USAGE [ARG...]: a bench script's command line. `bundle` calls the script's
# bundle function, `run [MODE]` (also what no argument means) its run function with MODE;
# anything else prints "usage: <script> USAGE" and exits 2.
dispatch_bundle_run() {
  local usage=$1
  shift
  case ${1:-run} in
    bundle) bundle ;;
    run) shift || true; run "$@" ;;
    *) echo "usage: $0 $usage" >&2; exit 2 ;;
  esac
}
