#!/usr/bin/env bash
# One command from a fresh clone: a virtual environment with torch and every pypto-serving
# distribution, then the OpenAI-compatible server on the embedded model (tiny-deepseek-v4).
#
#   ./quickstart.sh                 # CPU: torch==2.13.0, serve on http://127.0.0.1:8000
#   ./quickstart.sh --cuda          # the CUDA build of torch 2.13.0 from PyPI
#   ./quickstart.sh --npu           # Ascend: torch 2.13.0 + torch-npu (the 'npu' extra)
#   ./quickstart.sh --port 9000 --model tiny-qwen3
#   ./quickstart.sh --no-serve      # install only
#
# Options: --venv DIR (default .venv), --cpu | --cuda | --npu, --port N, --model NAME|DIR,
# --system-site-packages (reuse packages already installed for this python), --no-serve.
# Anything after -- goes to `pypto-serving serve`.
set -euo pipefail
cd "$(dirname "$0")"

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
[ -x "$venv/bin/python" ] || python3 -m venv "${venv_flags[@]}" "$venv"
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)

echo "quickstart: installing torch ($device) into $venv" >&2
case "$device" in
    # On Linux x86_64 PyPI's torch wheel is the CUDA build; machines with a local CPU wheel take it.
    cpu | cuda) "${pip[@]}" torch==2.13.0 ;;
    npu) "${pip[@]}" torch==2.13.0 torch-npu ;;
esac
echo "quickstart: installing pypto-serving, its kernels and plugins" >&2
"${pip[@]}" ./ ./kernels ./plugins/qwen ./plugins/deepseek_mtp ./plugins/sync_sched ./plugins/async_sched

[ "$serve" = 1 ] || { echo "quickstart: installed; run $venv/bin/pypto-serving serve" >&2; exit 0; }
args=(serve --port "$port" --device "$device")
[ -n "$model" ] && args+=(--model "$model")
echo "quickstart: $venv/bin/pypto-serving ${args[*]} ${serve_args[*]}" >&2
exec "$venv/bin/pypto-serving" "${args[@]}" "${serve_args[@]}"
