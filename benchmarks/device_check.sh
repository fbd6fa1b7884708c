#!/usr/bin/env bash
# The checks that need a real accelerator, in one run (a CUDA host with torch; no network needed):
#   1. the real-device tests (tests/plugins/*/test_real_device.py), the CUDA kernel tests and the
#      fake-device tests, with JUnit XML;
#   2. per shape in $SHAPES (make_models.py names; default the Qwen3-0.6B shape): a decode-step profile
#      (benchmarks/decode_profile.py --device cuda), then benchmarks/compare.py on the device
#      (pypto-serving sync and async beside HF transformers on the same device).
# The stages' limits add up to under ten minutes (one call of a lent machine), installs included.
#
#     bash benchmarks/device_check.sh OUT_DIR
#
# Packages the host lacks can lie as wheels in .whl/ (installed to a private target first); the
# project's distributions are installed without their dependencies. Each stage has its own time limit
# so that a stuck stage still leaves the others' results in OUT_DIR.
set -uo pipefail
out=${1:?usage: device_check.sh OUT_DIR}
logs=$(mktemp -d)  # every stage's log; tarred into OUT_DIR/logs.tgz at the end
mkdir -p "$out"
export TORCH_DEVICE_BACKEND_AUTOLOAD=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONHASHSEED=0 PYTHONUNBUFFERED=1
py=$(command -v python3)
if compgen -G ".whl/*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
"$py" -m pip install -q --no-index --no-deps --no-build-isolation \
    -e . -e kernels -e plugins/qwen -e plugins/deepseek_mtp -e plugins/sync_sched -e plugins/async_sched || exit 1
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    "$py" -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)'
    nproc
} 2>&1 | tee "$out/summary.txt"

stage() {  # stage NAME SECONDS COMMAND...: its exit status and time in OUT_DIR/summary.txt
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" >"$logs/$name.log" 2>&1
    echo "rc=$? ${name} $((SECONDS - start))s" | tee -a "$out/summary.txt"
    tail -5 "$logs/$name.log"
}

# A module that fails to import (the device's torch may be older than the project's pin) must not
# stop the others: --continue-on-collection-errors.
stage real_device 150 "$py" -m pytest -q -p no:cacheprovider -rfEs --continue-on-collection-errors \
    --junitxml="$out/real_device.xml" \
    tests/plugins/qwen/test_real_device.py tests/plugins/deepseek_mtp/test_real_device.py \
    tests/kernels/test_kernels_backends.py tests/kernels/test_kernels_registry.py \
    tests/plugins/qwen/test_fake_device.py tests/plugins/deepseek_mtp/test_fake_device.py
cp "$logs/real_device.log" "$out/"

mkdir -p /tmp/peers/hf/bin
printf '#!/bin/sh\nexec %s "$@"\n' "$py" >/tmp/peers/hf/bin/python
chmod +x /tmp/peers/hf/bin/python
stage make_models 90 "$py" benchmarks/make_models.py --out /tmp/models ${SHAPES:-0.6b}
for shape in ${SHAPES:-0.6b}; do
    stage "profile_$shape" 60 "$py" benchmarks/decode_profile.py --model "/tmp/models/qwen3-$shape" --device cuda \
        --requests 64 --context 260 --steps 5
    cp "$logs/profile_$shape.log" "$out/"
    stage "compare_$shape" 240 "$py" benchmarks/compare.py --model "/tmp/models/qwen3-$shape" --device cuda \
        --peers hf --peers-dir /tmp/peers --out-md "$out/compare_$shape.md" --out-json "$logs/compare_$shape.json" \
        --out-png "$logs/compare_$shape.png" --work-dir "$logs/work_$shape"
done
tar -czf "$out/logs.tgz" --exclude='*.safetensors' -C "$logs" .
