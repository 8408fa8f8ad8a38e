#!/usr/bin/env bash
# Where the plugin's cost on plain CuPy over UCXX comes from: the handoff benchmark's UCXX baseline against the
# plugin with a plain CuPy array, under variants of the setup and of the package. Runs on a GPU machine (with the
# device tool: carry .whl .whl-ucx, and .old for the snapshot variants: .old/snapshots.tar.xz, 150 KB, keeps the
# carry under 64 MiB):
#   bash scripts/ucxx-bisect.sh
# Each variant runs benchmarks/handoff.py --placements same --methods ucxx,ucxx+gpupool-plain, interleaved rounds,
# so the plugin's run and its baseline share the cluster-to-cluster drift; the table of each lands in $OUT.
# VARIANTS (default "default host onegpu old") picks which: default (this package), host (host pools), onegpu (one
# GPU visible), old (the package of commit 6d06220), at-<commit> (the package of another commit's snapshot).
# BISECT_SIZES, BISECT_ROUNDS, BISECT_PLACEMENTS (default "same"; "other": one worker per GPU) tune the run.
set -uo pipefail
OUT=${OUT:-/tmp/ucxx-bisect-out}
mkdir -p "$OUT" /tmp/site
WHEELS=(.whl/*.whl)
[ -d .whl-ucx ] && WHEELS+=(.whl-ucx/*.whl)
(
  flock 9
  if [ ! -f /tmp/site/.gpupool-installed ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${WHEELS[@]}" || exit 1
    touch /tmp/site/.gpupool-installed
  fi
) 9>/tmp/gpupool-install.lock || exit 1
export PYTHONUNBUFFERED=1
SIZES=${BISECT_SIZES:-1GiB,4GiB}
ROUNDS=${BISECT_ROUNDS:-2}
ARGS=(--placements "${BISECT_PLACEMENTS:-same}" --methods ucxx,ucxx+gpupool-plain --sizes "$SIZES" --rounds "$ROUNDS" --repeats 5 --budget 110)
here=$PWD
for v in ${VARIANTS:-default host onegpu old}; do
  echo "== $v"
  case $v in
    default) (export PYTHONPATH=/tmp/site:$here; timeout 150 python3 benchmarks/handoff.py "${ARGS[@]}") ;;
    host) (export PYTHONPATH=/tmp/site:$here; timeout 150 python3 benchmarks/handoff.py "${ARGS[@]}" --kind host) ;;
    # one GPU visible: no peer GPU at all, for the plugin and the baseline alike
    onegpu) (export PYTHONPATH=/tmp/site:$here CUDA_VISIBLE_DEVICES=0
             timeout 150 python3 benchmarks/handoff.py "${ARGS[@]}") ;;
    # a commit's package and handoff.py (.old/snapshots.tar.xz: one folder per commit, made with
    # git archive <commit> dask_gpupool benchmarks/handoff.py); "old" is 6d06220
    old|at-*) c=${v#at-}; [ "$v" = old ] && c=6d06220
       mkdir -p /tmp/snapshots && tar xJf .old/snapshots.tar.xz -C /tmp/snapshots "./$c"
       (cd "/tmp/snapshots/$c" && export PYTHONPATH=/tmp/site:$PWD && timeout 150 python3 benchmarks/handoff.py "${ARGS[@]}") ;;
  esac > "$OUT/$v.log" 2>&1
  echo "exit $?"
  sed -n '/^consumer transfer time/,$p' "$OUT/$v.log" | grep -v "^$"
done
# The device tool brings back at most a few files: pack them.
(cd "$OUT" && tar czf /tmp/ucxx-bisect.tgz --exclude=ucxx-bisect.tgz . && find . -type f -delete && mv /tmp/ucxx-bisect.tgz .)
