#!/usr/bin/env bash
# Runs on the GPU machine (device tool): the whole test suite in parts side by side, each through
# scripts/gpu-check.sh with its own log folder under $OUT: the gpu-marked tests (with the demo and the example),
# and the CPU tests (not gpu-marked) in three parts: tests/handoff, tests/dask, and the others. Parts, because a
# device command ends at 600 s and the CPU tests alone take 456-471 s beside the gpu-marked ones (one H100,
# 2026-11-25).
#   carry: [".whl", ".whl-ucx", ".whl-vk", ".gl"]   command: bash scripts/gpu-suite.sh
# Prints each part's pytest summary last; the exit status is 0 only when every part passed. $OUT is packed into
# one file (the device tool brings back only a few files).
#
# The gpu-marked tests are selected by their marker (pytest -m gpu), wherever they live: the GPU modules (each
# gpu-marked as a whole) and the device cases of the scenarios that run on every pool kind (ids device-one-gpu,
# device-two-gpus). HALF splits them by name (pytest -k) into groups of one device command each, for machines
# where they do not end within one (their pytest takes 452-480 s on one H100, 2026-11-25):
#   HALF=a   the ones that use neither UCX nor two GPUs, with the demo and the example (461 s on one H100);
#   HALF=a1, HALF=a2   HALF=a in two by name (a2: staging, device objects, chains, layouts, ...), with the demo and
#            the example in a1;
#   HALF=c   the ones that need two GPUs and not UCX (all skipped on one GPU);
#   HALF=b   the UCX ones, beside the three CPU parts;
#   HALF=two every one that needs two GPUs, UCX or not, and no CPU part: for a two-GPU machine whose one-GPU cases
#            pass at the same package code on one GPU.
# a1 + a2 = a, and a + b + c = every gpu-marked test.
set -uo pipefail
O=${OUT:-/tmp/gpu-suite-out}
mkdir -p "$O"
TWO_GPUS="(two-gpus or two_gpus or across_gpus or another_gpu or per_gpu or rotated_visible or not_visible_to)"
A2="(stage or staged or device_objects or cuda_serialized or chain or layout or imported_twice or zero_d or garbage_collector or spilled or pickles or client_gathers or imports_after_cupy)"
GPU_K=""
[ "${HALF:-}" = a ] && GPU_K="not ucx and not $TWO_GPUS"
[ "${HALF:-}" = a1 ] && GPU_K="not ucx and not $TWO_GPUS and not $A2"
[ "${HALF:-}" = a2 ] && GPU_K="not ucx and not $TWO_GPUS and $A2"
[ "${HALF:-}" = c ] && GPU_K="not ucx and $TWO_GPUS"
[ "${HALF:-}" = b ] && GPU_K="ucx"
[ "${HALF:-}" = two ] && GPU_K="$TWO_GPUS"
(OUT=$O/gpu PART=tests PYTEST_M=gpu PYTEST_K="$GPU_K" DEMO=$(case "${HALF:-}" in b|c|two|a2) echo 0;; *) echo 1;; esac) \
   DEADLINE=592 PYTEST_TIMEOUT=540 bash scripts/gpu-check.sh > "$O/gpu.txt" 2>&1; echo $? > "$O/gpu.rc") &
PARTS="gpu"
if [ "${HALF:-}" != a ] && [ "${HALF:-}" != a1 ] && [ "${HALF:-}" != a2 ] && [ "${HALF:-}" != c ] && [ "${HALF:-}" != two ]; then
  # tests/dask is a part of its own: with it, the CPU tests outside tests/handoff take more than a part's 480 s.
  PARTS="gpu handoff dask rest"
  (OUT=$O/handoff PART=tests DEMO=0 PYTEST_M="not gpu" PYTEST_PATHS=tests/handoff bash scripts/gpu-check.sh > "$O/handoff.txt" 2>&1
   echo $? > "$O/handoff.rc") &
  (OUT=$O/dask PART=tests DEMO=0 PYTEST_M="not gpu" PYTEST_PATHS=tests/dask DEADLINE=592 PYTEST_TIMEOUT=560 \
     bash scripts/gpu-check.sh > "$O/dask.txt" 2>&1; echo $? > "$O/dask.rc") &
  (OUT=$O/rest PART=tests DEMO=0 PYTEST_M="not gpu" PYTEST_PATHS="$(ls -d tests/* | grep -vE '^tests/(handoff|dask|conftest\.py|__)' | tr '\n' ' ')" \
     DEADLINE=592 PYTEST_TIMEOUT=560 bash scripts/gpu-check.sh > "$O/rest.txt" 2>&1; echo $? > "$O/rest.rc") &
fi
wait
rc=0
for part in $PARTS; do
  r=$(cat "$O/$part.rc" 2>/dev/null || echo missing)
  [ "$r" = 0 ] || rc=1
  echo "== $part: exit $r"
  grep -aE "^(FAILED|ERROR)" "$O/$part/pytest.log" 2>/dev/null | head -10
  grep -aE "^(demo|example) exit" "$O/$part.txt"
  tail -n 1 "$O/$part/pytest.log" 2>/dev/null
done
(cd "$O" && tar czf /tmp/gpu-suite.tgz . && rm -rf "${O:?}"/* && mv /tmp/gpu-suite.tgz "$O/")
exit $rc
