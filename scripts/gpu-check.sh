#!/usr/bin/env bash
# The GPU check: the whole test suite (gpu-marked tests included), the demo and the example, then benchmarks, on a
# GPU machine, from a clone with the wheels beside it (with the device tool: carry [".whl", ".whl-ucx"], command
# `bash scripts/gpu-check.sh`). Full logs go under $OUT; each step prints its table, the handoff table last. The exit
# status is pytest's (0 when the tests passed or were not run), so a caller sees a failed suite.
#
# Wheels, installed without an index into /tmp/site, once per machine and set of wheels:
#   .whl        the dependencies the machine's Python lacks: dask and distributed 2026.8.0, tornado, zict, tblib,
#               partd, locket, and cuda-core 1.2.2 with cuda-pathfinder where the machine's cuda-core is older
#               (the package needs 1.2.2: it frees host-only buffers without a CUDA context).
#   .whl-ucx    (optional) the UCXX wheels (distributed-ucxx-cu13 0.52, ucxx-cu13 0.52, libucxx-cu13 0.52,
#               libucx-cu13 1.21, rmm-cu13/librmm-cu13 26.10, rapids-logger 0.3): the UCXX tests and ucxx rows.
#   .whl-dc     (optional) dask-cuda 26.10 and what it imports that the machine lacks (nvidia-ml-py, click, pandas
#               with python-dateutil, pytz, tzdata and six), with rmm-cu13/librmm-cu13 26.10 and rapids-logger 0.3 for
#               its RMM options: the dask-cuda tests. Carried with .whl instead of .whl-ucx (64 MiB together).
#   .whl-vk     (optional) the vkgdr, cffi and pycparser wheels, kept apart from .whl so that .whl and .whl-ucx stay
#               under the tool's 64 MiB carry limit; .gl holds the Vulkan loader's .debs vkgdr needs (see below).
#
# What runs:
#   PART        tests: the suite, the demo and the example; bench: the benchmarks and the ETL example; unset: both
#               (both may not fit one 10-minute command when the handoff budget is large).
#   PYTEST_M    selects tests by marker (pytest -m, e.g. "gpu"); PYTEST_K by name (pytest -k); PYTEST_PATHS the
#               paths (default tests); PYTEST_ARGS adds pytest options;
#               PYTEST_TIMEOUT caps the suite (default 480 s).
#   DEMO=0      skips the demo and the example.
#   MAPPING=0   skips the pool-mapping benchmark (mapping a peer's pool and importing its buffers, every pool kind).
#   SUBALLOC=0  skips the placement allocator benchmark.
#   ETL=0       skips the ETL example; ETL_LAYOUTS lists its layouts (default "shared"; per-gpu, dask-cuda);
#               ETL_ARGS adds options to it.
#   HANDOFF_BUDGET  seconds for benchmarks/handoff.py (default 360; 0 skips it); HANDOFF_ARGS adds options.
# Benchmarks that run only when asked (NAME=1; NAME_ARGS adds options where named):
#   ARRAY_BENCH      benchmarks/dask_array.py, a dask.array program with and without GPUPool() at its defaults, for
#                    each of ARRAY_BENCH_PROTOCOLS (default "tcp"; "tcp ucxx" both); ARRAY_BENCH_ARGS. Not DASK_*:
#                    Dask reads every DASK_* variable as config.
#   WORKLOADS        benchmarks/workloads.py, dask.array workloads, plain Dask (TCP, UCXX) against GPUPool() at its
#                    defaults; WORKLOADS_ARGS; WORKLOADS_TIMEOUT caps it (default 560 s).
#   COPY_OR_HANDOFF  benchmarks/copy_or_handoff.py, each sample handed over and copied (or staged and sent through
#                    the comm) back to back; COPY_OR_HANDOFF_ARGS, e.g. "--placement other --plain".
#   GATHER           benchmarks/gather.py, one reply of 1, 8, 32 pool arrays; GATHER_ARGS.
#   BUSY             benchmarks/busy_producer.py, handoffs while the producer's GPU runs another stream's kernels,
#                    gpupool.handoff-ordering sync against device; BUSY_ARGS.
#   STAGED           benchmarks/staged_behind_tasks.py, a staged task result while later tasks keep the default
#                    stream busy, the task's event against the default stream; STAGED_ARGS.
#   BUSY_PY          benchmarks/busy_python.py, a producer busy in Python, Dask against a handoff; BUSY_PY_ARGS.
#   UCX_PAIRS        benchmarks/ucx_pairs.py, four workers as two hosts of two GPUs, every pair, UCXX against the
#                    plugin (all on GPU 0 with one GPU); UCX_PAIRS_ARGS; UCX_PAIRS_TIMEOUT caps it (default 300 s).
#   VKGDR            benchmarks/vkgdr_landing.py, TCP copies into pinned staging and a copy against straight into
#                    vkgdr-mapped device memory; VKGDR_ARGS. Needs .gl and .whl-vk.
#   DEATH            benchmarks/exporter_death.py, what an importer reads after its exporter's SIGKILL.
#   CHAOS_SECONDS    runs benchmarks/chaos.py for that long (default 0: skipped); CHAOS_ARGS. CHAOS_BG runs it in
#                    the background across two commands on one machine (below).
#
# DEADLINE (seconds from this script's start, default 570) caps every step's timeout so that the script ends, packs
# its logs and prints its tables before the tool's 600 s limit: a command cut off by that limit brings nothing
# back. A step with no time left is skipped and says so. Two runs side by side each count from their own start.
# Everything under $OUT is packed into logs.tgz at the end when more than 8 files would come back.
set -uo pipefail
DEADLINE=${DEADLINE:-570}
# left LIMIT: LIMIT, or the seconds left before DEADLINE (less 15 s to pack the logs) when fewer; at least 1
# (timeout 0 would mean no limit).
left() { local l=$((DEADLINE - SECONDS - 15)); [ "$1" -lt "$l" ] && l=$1; [ "$l" -lt 1 ] && l=1; echo "$l"; }
# has_time NAME: true while at least 20 s are left; otherwise says that NAME was skipped.
has_time() { [ "$(left 20)" -ge 20 ] && return 0; echo "== $1: skipped, out of time (DEADLINE=$DEADLINE s, ${SECONDS}s used)"; return 1; }
TESTS_RC=0
OUT=${OUT:-/tmp/gpu-check-out}
mkdir -p "$OUT"
WHEELS=(.whl/*.whl)
[ -d .whl-ucx ] && WHEELS+=(.whl-ucx/*.whl)
[ -d .whl-dc ] && WHEELS+=(.whl-dc/*.whl)
[ -d .whl-vk ] && WHEELS+=(.whl-vk/*.whl)
# Once per machine: a second run on the same machine must not rewrite the packages under a chaos run still going
# in the background. Under a lock: two runs started side by side would both install at once, and one can fail
# inside pip (FileNotFoundError on a file the other removed).
mkdir -p /tmp/site
(
  flock 9
  # one marker per set of wheels: a later run that carries more (.whl-vk) installs again
  marker=/tmp/site/.gpupool-installed-$(printf '%s\n' "${WHEELS[@]##*/}" | md5sum | cut -c1-12)
  if [ ! -f "$marker" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${WHEELS[@]}" || exit 1
    touch "$marker"
  fi
) 9>/tmp/gpupool-install.lock || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
{ nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv;
  python3 -c "import cuda.core, cuda.bindings, dask, distributed; print('cuda.core', cuda.core.__version__, 'cuda.bindings', cuda.bindings.__version__, 'dask', dask.__version__)"; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
# CHAOS_BG=start starts the chaos benchmark (CHAOS_SECONDS, default 600) detached (setsid) and returns: a 10-minute
# run does not fit one 10-minute command. CHAOS_BG=collect, in the next command on the same machine, waits for it
# and brings its log and JSON back.
if [ "${CHAOS_BG:-}" = start ]; then
  mkdir -p /tmp/chaos-out
  OUT=/tmp/chaos-out setsid nohup python3 benchmarks/chaos.py --seconds "${CHAOS_SECONDS:-600}" ${CHAOS_ARGS:-} \
    > /tmp/chaos-out/chaos.log 2>&1 < /dev/null &
  echo "chaos started in the background (pid $!)"
  exit 0
fi
if [ "${CHAOS_BG:-}" = collect ]; then
  for _ in $(seq 300); do pgrep -f "[b]enchmarks/chaos.py --seconds" > /dev/null || break; sleep 1; done
  cp /tmp/chaos-out/* "$OUT"/ 2>/dev/null
  grep "^t=" /tmp/chaos-out/chaos.log | tail -2; sed -n '/^chaos:/,$p' /tmp/chaos-out/chaos.log
  exit 0
fi
# The Vulkan loader and NVIDIA's GL dispatch libraries for vkgdr (where pulled copies land when it runs, its GPU test and
# benchmarks/vkgdr_landing.py), when .gl is carried: the device README's .deb set (libvulkan1 libegl1 libglvnd0
# libopengl0 libgl1 libglx0 libgles2). With libvulkan1 alone vkCreateInstance fails with
# VK_ERROR_INCOMPATIBLE_DRIVER; with the whole set vkgdr opens.
# Under the install lock, once per machine: two runs side by side would unpack at once, and one dpkg -x can fail on
# a file the other has just written.
if ls .gl/*.deb > /dev/null 2>&1; then
  (
    flock 9
    if [ ! -f /tmp/site/.gpupool-gl-unpacked ]; then
      for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
      touch /tmp/site/.gpupool-gl-unpacked
    fi
  ) 9>/tmp/gpupool-install.lock
  export VK_DRIVER_FILES=${VK_DRIVER_FILES:-/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json}
  export __EGL_VENDOR_LIBRARY_FILENAMES=${__EGL_VENDOR_LIBRARY_FILENAMES:-/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json}
  { echo "VK_DRIVER_FILES=$VK_DRIVER_FILES"; ls -l "$VK_DRIVER_FILES" /usr/share/vulkan/icd.d /etc/vulkan/icd.d 2>&1;
    ldconfig -p | grep -E "libvulkan|libGLX_nvidia|libGLdispatch"; } > "$OUT/vulkan-env.txt" 2>&1
fi
PART=${PART:-all}
if [ "$PART" != bench ]; then
# -v: each test's name and outcome as it ends, so a run cut off by its time limit still says which ran and how
# failures as they happen (tests/conftest.py): a run cut off by PYTEST_TIMEOUT keeps their bodies
export GPUPOOL_FAILURES_LOG="$OUT/failures.log"
timeout $(left ${PYTEST_TIMEOUT:-480}) python3 -m pytest ${PYTEST_PATHS:-tests} ${PYTEST_M:+-m "$PYTEST_M"} ${PYTEST_K:+-k "$PYTEST_K"} -p no:cacheprovider -o addopts="" -v -rA --durations=8 --timeout 180 ${PYTEST_ARGS:-} > "$OUT/pytest.log" 2>&1
TESTS_RC=$?
echo "pytest exit: $TESTS_RC"
echo "== failures/errors"; grep -aE "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20
# the gpu-marked tests: every result with PYTEST_M=gpu; else those of the GPU modules and the device cases
echo "== gpu tests"; if [ "${PYTEST_M:-}" = gpu ]; then grep -aE "^(PASSED|FAILED|SKIPPED|ERROR) " "$OUT/pytest.log"
else grep -aE "^(PASSED|FAILED|SKIPPED|ERROR) .*(/test_device_(memory|handoff|segments|forwarding|copies|frames|values)\.py|/test_(ucxx|dask_cuda|plain_cupy)\.py|\[device-)" "$OUT/pytest.log"; fi
[ -s "$OUT/failures.log" ] && { echo "== failure bodies (failures.log, last 60 lines)"; tail -n 60 "$OUT/failures.log"; }
[ "$TESTS_RC" = 124 ] && { echo "== cut off by PYTEST_TIMEOUT; the tests that ended:"; grep -aE "::.* (PASSED|FAILED|ERROR|SKIPPED)" "$OUT/pytest.log" | tail -40; }
echo "== slowest"; grep -aE "^[0-9.]+s call" "$OUT/pytest.log" | head -8
echo "== summary"; tail -n 1 "$OUT/pytest.log"
if [ "${DEMO:-1}" != 0 ] && has_time demo; then
echo "== demo"; timeout $(left 100) python3 -m dask_gpupool demo > "$OUT/demo.log" 2>&1; echo "demo exit: $?"; tail -n 4 "$OUT/demo.log"
echo "== example"; timeout $(left 120) python3 examples/zero_copy_handoff.py > "$OUT/example.log" 2>&1; echo "example exit: $?"; tail -n 6 "$OUT/example.log"
fi
fi
if [ "$PART" != tests ]; then
if [ "${MAPPING:-1}" != 0 ] && has_time "pool mapping"; then
echo "== pool mapping"; timeout $(left 150) python3 benchmarks/pool_mapping.py > "$OUT/bench.log" 2>&1
echo "pool mapping exit: $?"; sed -n '/^first import/,$p' "$OUT/bench.log"
fi
if [ "${SUBALLOC:-1}" != 0 ] && has_time suballocator; then
echo "== placement allocator: the arena alone and in a device pool's segments"; timeout $(left 120) python3 benchmarks/suballocator.py > "$OUT/suballocator.log" 2>&1
echo "suballocator exit: $?"; sed -n '/^case/,$p' "$OUT/suballocator.log"
fi
if [ "${ETL:-1}" != 0 ] && has_time etl; then
for layout in ${ETL_LAYOUTS:-shared}; do
echo "== etl example, layout $layout (CuPy chunks) ${ETL_ARGS:-}"
timeout $(left 150) python3 examples/etl_pipeline.py --size 1GiB --chunks 16 --layout "$layout" ${ETL_ARGS:-} --plot "$OUT/etl_$layout.png" > "$OUT/etl_$layout.log" 2>&1
echo "etl exit: $?"; grep -v "^20\|^gpupool:" "$OUT/etl_$layout.log" | tail -n 9
done
fi
BUDGET=${HANDOFF_BUDGET:-360}
if [ "$BUDGET" != 0 ] && has_time "handoff benchmark"; then
  echo "== handoff benchmark"
  timeout $(left $((BUDGET + 120))) python3 benchmarks/handoff.py --budget "$BUDGET" ${HANDOFF_ARGS:-} > "$OUT/handoff.log" 2>&1
  echo "handoff exit: $?"
  grep -E "not available|FAILED|out of time" "$OUT/handoff.log" | head -10
  sed -n '/^consumer transfer time/,$p' "$OUT/handoff.log"
fi
fi
if [ "${ARRAY_BENCH:-0}" != 0 ] && has_time dask_array; then  # a dask.array program with and without GPUPool() at its defaults
  for proto in ${ARRAY_BENCH_PROTOCOLS:-tcp}; do
    echo "== dask.array, plugin vs none ($proto)"
    timeout $(left 240) python3 benchmarks/dask_array.py --protocol "$proto" ${ARRAY_BENCH_ARGS:-} > "$OUT/dask_array_$proto.log" 2>&1
    echo "dask_array exit: $?"; sed -n '/^-- /p;/^[0-9]*x[0-9]* f8/,$p' "$OUT/dask_array_$proto.log"
  done
fi
if [ "${WORKLOADS:-0}" != 0 ] && has_time workloads; then  # dask.array workloads, plain Dask (TCP, UCXX) vs GPUPool() at defaults
  echo "== workloads ${WORKLOADS_ARGS:-}"; timeout $(left ${WORKLOADS_TIMEOUT:-560}) python3 benchmarks/workloads.py ${WORKLOADS_ARGS:-} > "$OUT/workloads.log" 2>&1
  echo "workloads exit: $?"; sed -n '/^[0-9]*x[0-9]* f8/,$p' "$OUT/workloads.log"
fi
if [ "${GATHER:-0}" != 0 ] && has_time gather; then  # one reply of many handoffs: claims batched per exporter (GATHER_ARGS adds options)
  echo "== gather"; timeout $(left 240) python3 benchmarks/gather.py ${GATHER_ARGS:-} > "$OUT/gather.log" 2>&1
  echo "gather exit: $?"; grep "values" "$OUT/gather.log"
fi
if [ "${COPY_OR_HANDOFF:-0}" != 0 ] && has_time "copy or handoff"; then  # the handoff and stage thresholds: both paths per sample (COPY_OR_HANDOFF_ARGS)
  echo "== copy or handoff ${COPY_OR_HANDOFF_ARGS:-}"; timeout $(left 240) python3 benchmarks/copy_or_handoff.py ${COPY_OR_HANDOFF_ARGS:-} > "$OUT/copy_or_handoff.log" 2>&1
  echo "copy or handoff exit: $?"; sed -n '/median of/,$p' "$OUT/copy_or_handoff.log"
fi
if [ "${BUSY:-0}" != 0 ] && has_time "busy producer"; then  # handoff latency while the producer's GPU runs another stream's kernels
  echo "== busy producer ${BUSY_ARGS:-}"; timeout $(left 240) python3 benchmarks/busy_producer.py ${BUSY_ARGS:-} > "$OUT/busy.log" 2>&1
  echo "busy producer exit: $?"; sed -n '/^consumer transfer time/,$p' "$OUT/busy.log"
fi
if [ "${STAGED:-0}" != 0 ] && has_time "staged behind tasks"; then  # a staged task result while later tasks keep the default stream busy
  echo "== staged behind tasks ${STAGED_ARGS:-}"; timeout $(left 300) python3 benchmarks/staged_behind_tasks.py ${STAGED_ARGS:-} > "$OUT/staged_behind_tasks.log" 2>&1
  sed -n '/consumer transfer time/,$p' "$OUT/staged_behind_tasks.log"
fi
if [ "${BUSY_PY:-0}" != 0 ] && has_time "busy python"; then  # a producer whose task holds the GIL: Dask vs handoff
  echo "== busy python ${BUSY_PY_ARGS:-}"; timeout $(left 240) python3 benchmarks/busy_python.py ${BUSY_PY_ARGS:-} > "$OUT/busy_python.log" 2>&1
  echo "busy python exit: $?"; sed -n '/value A -> B/,$p' "$OUT/busy_python.log"
fi
if [ "${UCX_PAIRS:-0}" != 0 ] && has_time "ucx pairs"; then  # every pair of four workers that look like two hosts, UCXX vs plugin
  echo "== ucx pairs ${UCX_PAIRS_ARGS:-}"; timeout $(left ${UCX_PAIRS_TIMEOUT:-300}) python3 benchmarks/ucx_pairs.py ${UCX_PAIRS_ARGS:-} > "$OUT/ucx_pairs.log" 2>&1
  echo "ucx pairs exit: $?"; sed -n '/^consumer transfer time/,$p' "$OUT/ucx_pairs.log"
fi
if [ "${VKGDR:-0}" != 0 ] && has_time vkgdr; then  # land TCP copies straight in device memory (vkgdr) vs pinned staging
  # (carry .gl and .whl-vk: the Vulkan set-up is at the top)
  echo "== vkgdr landing ${VKGDR_ARGS:-}"; timeout $(left 200) python3 benchmarks/vkgdr_landing.py ${VKGDR_ARGS:-} > "$OUT/vkgdr.log" 2>&1
  echo "vkgdr exit: $?"; sed -n '/over loopback TCP/,$p' "$OUT/vkgdr.log"; tail -n 3 "$OUT/vkgdr.log"
fi
if [ "${DEATH:-0}" != 0 ] && has_time "exporter death"; then  # what an importer reads after its exporter's SIGKILL: pool vs VMM memory
  echo "== exporter death"; timeout $(left 280) python3 benchmarks/exporter_death.py > "$OUT/exporter_death.log" 2>&1
  echo "exporter death exit: $?"; sed -n '/^mechanism/,$p' "$OUT/exporter_death.log"
fi
if [ "${CHAOS_SECONDS:-0}" != 0 ] && has_time chaos; then
  echo "== chaos (${CHAOS_SECONDS} s)"
  timeout $(left $((CHAOS_SECONDS + 240))) python3 benchmarks/chaos.py --seconds "$CHAOS_SECONDS" ${CHAOS_ARGS:-} > "$OUT/chaos.log" 2>&1
  echo "chaos exit: $?"; sed -n '/^chaos:/,$p' "$OUT/chaos.log"
fi
if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
  (cd "$OUT" && tar czf /tmp/logs.tgz --exclude=logs.tgz . && find . -type f -delete && mv /tmp/logs.tgz .)
fi
exit "$TESTS_RC"
