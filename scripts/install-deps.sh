#!/usr/bin/env bash
# Installs every Debian package that kvr's build, tests, benchmarks and demo need.
# Safe to run any number of times: apt-get skips what is already installed, and the
# package index is refreshed only when it is missing or older than a day.
set -euo pipefail

packages=(
  # toolchain
  build-essential cmake ninja-build ccache pkg-config git python3 python3-venv python3-pip
  # control plane
  libgrpc++-dev libgrpc-dev protobuf-compiler protobuf-compiler-grpc libprotobuf-dev grpc-proto
  libabsl-dev
  libcpp-httplib-dev  # the controller's OpenAI-compatible HTTP(S) API (cpp-httplib on OpenSSL 3)
  libcurl4-openssl-dev  # kvr bench's HTTP client (--backend openai-chat|openai-completions)
  # data plane
  libucx-dev ucx-utils libibverbs-dev librdmacm-dev rdma-core
  # observability
  prometheus-cpp-dev prometheus
  # tests and benchmarks
  libgtest-dev libgmock-dev googletest libbenchmark-dev iproute2
  python3-matplotlib  # retrieval/eval/plot_retrieval_eval.py (kvr eval retrieval plots)
  # compute
  libopenblas-dev
  # utilities (flags, config, JSON, logging, Unicode regex)
  libcli11-dev libyaml-cpp-dev nlohmann-json3-dev libspdlog-dev libfmt-dev libpcre2-dev
  # Unicode normalisation (NFC) for tokenizers whose tokenizer.json asks for it (Qwen2)
  libicu-dev
  # hashing in test tools (sha256 digests of dequantised tensors)
  libssl-dev
  # tools
  clang-format unzip curl
  # fuzzing and sanitizer builds (scripts/fuzz.sh, scripts/sanitizers.sh): clang and libFuzzer
  clang libclang-rt-14-dev
)

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
lists=/var/lib/apt/lists
if [ -z "$(find "$lists" -maxdepth 1 -name '*Packages*' -mtime -1 2>/dev/null | head -1)" ]; then
  $SUDO apt-get update -qq
fi
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
