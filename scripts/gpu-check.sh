#!/usr/bin/env bash
# Runs on the GPU machine (device tool): the whole test suite (gpu-marked tests included) and the
# pool benchmark, full logs under $OUT, a short table last. Same script every session:
#   carry: [".whl"]   command: bash scripts/gpu-check.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu-check-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
{ nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv;
  python3 -c "import cuda.core, cuda.bindings, dask, distributed; print('cuda.core', cuda.core.__version__, 'cuda.bindings', cuda.bindings.__version__, 'dask', dask.__version__)"; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
timeout 480 python3 -m pytest tests -p no:cacheprovider -o addopts="" -rA --durations=8 --timeout 180 > "$OUT/pytest.log" 2>&1
echo "pytest exit: $?"
timeout 150 python3 benchmarks/pool_mapping.py > "$OUT/bench.log" 2>&1
echo "bench exit: $?"
echo "== failures/errors"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20
echo "== gpu tests"; grep -E "^(PASSED|FAILED|SKIPPED|ERROR).*test_gpu" "$OUT/pytest.log"
echo "== slowest"; grep -E "^[0-9.]+s call" "$OUT/pytest.log" | head -8
echo "== summary"; tail -n 1 "$OUT/pytest.log"
tail -n 6 "$OUT/bench.log"
echo "== demo"; timeout 100 python3 -m dask_gpupool demo > "$OUT/demo.log" 2>&1; echo "demo exit: $?"; tail -n 4 "$OUT/demo.log"
echo "== example"; timeout 120 python3 examples/zero_copy_handoff.py > "$OUT/example.log" 2>&1; echo "example exit: $?"; tail -n 6 "$OUT/example.log"
