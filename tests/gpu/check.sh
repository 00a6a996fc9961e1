#!/usr/bin/env bash
# The GPU check: tierstore's CUDA copy path on a bare CUDA machine, in under 5 minutes.
#
#   tests/gpu/check.sh            (from a plain checkout; PYTHON=... to pick the interpreter)
#
# Needs python3 with a CUDA build of torch, numpy, xxhash, msgpack, hypothesis and pytest;
# vLLM and Ray are not needed (the vLLM and cuda-bindings executors are tested where they
# are there). Builds the C copy-and-hash module in place if a compiler is found, runs
# tests/gpu (ordering against a sleeping forward, bit-exact round trips per executor,
# expedited loads passing stores, no per-job GPU or pinned allocation), then the GB/s
# bench (tests/gpu/bench.py). Logs go to $OUT (or a temporary folder); the last line
# printed is the verdict: "GPU CHECK: PASS", "GPU CHECK: FAIL" or "GPU CHECK: SKIPPED".
# Exit status: 0 for PASS or SKIPPED, 1 for FAIL.
set -u
cd "$(dirname "$0")/../.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null && [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
LOGS=${OUT:-$(mktemp -d)}

cuda=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null)
if [ "$cuda" != "1" ]; then
  why="torch.cuda.is_available() is False"
  [ -z "$cuda" ] && why="torch does not import with $PY"
  echo "GPU CHECK: SKIPPED - no CUDA device ($why); nothing of the CUDA path was checked"
  exit 0
fi

ext=$("$PY" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
inc=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
so=tierstore/data/_fused_copy$ext
if [ ! -e "$so" ] && command -v cc >/dev/null; then
  cc -O3 -shared -fPIC -I"$inc" tierstore/data/fused_copy.c -o "$so" 2>"$LOGS/build.log" \
    || echo "C module not built (see $LOGS/build.log): the numpy path is used"
fi

"$PY" -c "import torch; print('GPU:', torch.cuda.get_device_name(), '| torch', torch.__version__, '| CUDA', torch.version.cuda)"
timeout 240 "$PY" -m pytest -q -p no:cacheprovider --confcutdir=tests/gpu -rs tests/gpu \
  2>&1 | tee "$LOGS/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
summary=$(grep -E "(passed|failed|error)" "$LOGS/gpu_tests.log" | tail -1)
timeout 120 "$PY" -m tests.gpu.bench --json "$LOGS/gpu_bench.json" 2>&1 | tee "$LOGS/gpu_bench.log"
bench_rc=${PIPESTATUS[0]}

if [ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]; then
  echo "GPU CHECK: PASS - tests: ${summary:-?}; bench: $LOGS/gpu_bench.json"
  exit 0
fi
echo "GPU CHECK: FAIL - tests exit $tests_rc (${summary:-no summary}), bench exit $bench_rc; logs in $LOGS"
exit 1
