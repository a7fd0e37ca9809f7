#!/usr/bin/env bash
# Runs logits_reference.py on the device machine (torch + transformers there; gguf carried as a
# wheel in .whl/). The 98 MB GGUF is over the device's 64 MiB carry limit, so it travels in two
# halves over two calls (the machine keeps /tmp while it is warm):
#   mkdir -p .whl .device/p1 .device/p2 && python3 -m pip download --no-deps -d .whl gguf==0.17.1
#   split -n 2 -d ~/.cache/kvr/models/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smolpart
#   mv /tmp/smolpart00 .device/p1/ && mv /tmp/smolpart01 .device/p2/
#   call 1, carry [.whl, .device/p1]: bash model/tests/scripts/logits_device.sh stage
#   call 2, carry [.device/p2]:       bash model/tests/scripts/logits_device.sh run
# then copy $OUT/logits/* into model/tests/fixtures/logits/.
set -euo pipefail
readonly kSha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
readonly stage_dir=/tmp/kvr-logits
mkdir -p "$stage_dir"
case "${1:-}" in
  stage)
    cp .device/p1/smolpart00 "$stage_dir/"
    python3 -m pip install -q --no-index --no-deps --target "$stage_dir/site" .whl/*.whl
    PYTHONPATH="$stage_dir/site" python3 -c \
      'import gguf, torch, transformers; print("gguf", gguf.__file__, "torch", torch.__version__, "transformers", transformers.__version__)'
    ;;
  run)
    cat "$stage_dir/smolpart00" .device/p2/smolpart01 > "$stage_dir/SmolLM2-135M-Instruct.Q4_1.gguf"
    echo "$kSha256  $stage_dir/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c -
    export PYTHONPATH="$stage_dir/site" CUDA_VISIBLE_DEVICES=""
    python3 model/tests/scripts/logits_reference.py \
      --gguf "$stage_dir/SmolLM2-135M-Instruct.Q4_1.gguf" --out "${OUT:-out}/logits"
    ;;
  *) echo "usage: $0 stage|run" >&2; exit 2 ;;
esac
