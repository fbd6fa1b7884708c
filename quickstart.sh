#!/usr/bin/env bash
# One command from a fresh clone: a virtual environment with torch and every pypto-serving
# distribution, then the OpenAI-compatible server on the embedded model (tiny-deepseek-v4).
#
#   ./quickstart.sh                 # CPU: torch==2.13.0 (the CPU build), serve on http://127.0.0.1:8000
#   ./quickstart.sh --cuda          # the CUDA build of torch 2.13.0 from PyPI
#   ./quickstart.sh --npu           # Ascend: torch 2.13.0 + torch-npu (the 'npu' extra)
#   ./quickstart.sh --port 9000 --model tiny-qwen3
#   ./quickstart.sh --no-serve      # install only
#
# Options: --venv DIR (default .venv), --cpu | --cuda | --npu, --port N, --model NAME|DIR,
# --system-site-packages (reuse packages already installed for this python), --no-serve.
# Anything after -- goes to `pypto-serving serve`. Afterwards `source .venv/bin/activate` puts
# `pypto-serving` on PATH (or call .venv/bin/pypto-serving).
set -euo pipefail
cd "$(dirname "$0")"

# PyTorch's index of CPU-only wheels (about 200 MB; PyPI's Linux x86_64 wheel is the multi-GB CUDA
# build); QUICKSTART_TORCH_CPU_INDEX names a mirror of it.
cpu_index=${QUICKSTART_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}

venv=.venv device=cpu port=8000 model="" serve=1 venv_flags=()
serve_args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --venv) venv=$2; shift ;;
        --cpu | --cuda | --npu) device=${1#--} ;;
        --port) port=$2; shift ;;
        --model) model=$2; shift ;;
        --system-site-packages) venv_flags+=(--system-site-packages) ;;
        --no-serve) serve=0 ;;
        --) shift; serve_args=("$@"); break ;;
        -h | --help) sed -n '2,14p' "$0"; exit 0 ;;
        *) echo "quickstart.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || { echo "quickstart.sh: needs Python 3.11 or newer (python3 is $(python3 -V))" >&2; exit 2; }
step() { echo "quickstart: [$1/3] $2" >&2; }
if [ -x "$venv/bin/python" ]; then
    step 1 "using the virtual environment $venv"
else
    step 1 "creating the virtual environment $venv"
    python3 -m venv "${venv_flags[@]}" "$venv"
fi
# No -q: pip's own lines and download bars are the progress of the minute the installs take.
pip=("$venv/bin/python" -m pip install --disable-pip-version-check)

if "$venv/bin/python" -c 'import sys, torch; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
    step 2 "torch 2.13.0 is already installed in $venv"
else
    case "$device" in
        cpu)
            # An extra index, so that pip's own indexes (and local wheels) still serve everything
            # else; pip picks 2.13.0+cpu over PyPI's 2.13.0 as the higher version. Without a
            # connection to it, pip's own indexes decide (machines with a local CPU wheel).
            if python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=10)' \
                "$cpu_index/torch/" 2>/dev/null; then
                step 2 "installing torch 2.13.0 (CPU build from $cpu_index) into $venv"
                "${pip[@]}" --extra-index-url "$cpu_index" torch==2.13.0
            else
                step 2 "installing torch 2.13.0 into $venv ($cpu_index is unreachable: pip's own indexes)"
                "${pip[@]}" torch==2.13.0
            fi ;;
        cuda) step 2 "installing torch 2.13.0 (CUDA build, several GB) into $venv"; "${pip[@]}" torch==2.13.0 ;;
        npu) step 2 "installing torch 2.13.0 and torch-npu into $venv"; "${pip[@]}" torch==2.13.0 torch-npu ;;
    esac
fi
step 3 "installing pypto-serving, its kernels and plugins into $venv"
"${pip[@]}" ./ ./kernels ./plugins/qwen ./plugins/deepseek_mtp ./plugins/sync_sched ./plugins/async_sched

echo "quickstart: installed. In a new shell, 'source $venv/bin/activate' puts pypto-serving on PATH" \
    "(or call $venv/bin/pypto-serving)" >&2
[ "$serve" = 1 ] || exit 0
args=(serve --port "$port" --device "$device")
[ -n "$model" ] && args+=(--model "$model")
echo "quickstart: $venv/bin/pypto-serving ${args[*]} ${serve_args[*]}" >&2
exec "$venv/bin/pypto-serving" "${args[@]}" "${serve_args[@]}"
