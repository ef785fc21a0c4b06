#!/usr/bin/env bash
# Two builds of spikecube in one device call, in turn, on the H200 machine:
# the one-pass and default-path figures of BENCHMARKS.md's table (CUDA),
# median of RUNS (3 by default) whole-process walls each, after one warm-up
# run per build (kernel cache). Spike times of the two builds are compared.
#
# Usage: benches/h200_two_builds.sh OLD_BINARY NEW_BINARY [WORK_DIR] [RUNS]
# Needs about 2 × 14 GB of disk for the two 10-minute recordings.
set -euo pipefail
old=$1
new=$2
work=${3:-/tmp/two_builds}
runs=${4:-3}
mkdir -p "$work"
[ -f "$work/flat/sim_g0_t0.imec0.ap.bin" ] || "$new" -q simulate --seconds 600 --out "$work/flat"
[ -f "$work/drift/sim_g0_t0.imec0.ap.bin" ] || "$new" -q simulate --seconds 600 --drift rigid --out "$work/drift"
wall() { # out-dir args...
    local out=$1; shift
    local t0 t1
    t0=$(date +%s.%N)
    "$@" -q --out "$out" >/dev/null
    t1=$(date +%s.%N)
    echo "$t1 - $t0" | bc
}
declare -A times
for path in one_pass default; do
    for v in old new; do
        bin=${!v}
        if [ $path = one_pass ]; then
            args=(detect "$work/flat/sim_g0_t0.imec0.ap.bin" --backend cuda --nblocks 0 --templates-from-data false)
        else
            args=(detect "$work/drift/sim_g0_t0.imec0.ap.bin" --backend cuda)
        fi
        wall "$work/out_${path}_$v" "$bin" "${args[@]}" >/dev/null # warm-up
    done
    for r in $(seq "$runs"); do
        for v in old new; do
            bin=${!v}
            if [ $path = one_pass ]; then
                args=(detect "$work/flat/sim_g0_t0.imec0.ap.bin" --backend cuda --nblocks 0 --templates-from-data false)
            else
                args=(detect "$work/drift/sim_g0_t0.imec0.ap.bin" --backend cuda)
            fi
            t=$(wall "$work/out_${path}_$v" "$bin" "${args[@]}")
            times[$path.$v]="${times[$path.$v]:-} $t"
        done
    done
    for v in old new; do
        med=$(echo ${times[$path.$v]} | tr ' ' '\n' | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
        echo "$path $v: walls${times[$path.$v]} s; median $med s"
    done
    if cmp -s "$work/out_${path}_old/spike_times.npy" "$work/out_${path}_new/spike_times.npy"; then
        echo "$path: spike_times.npy identical"
    else
        echo "$path: spike_times.npy DIFFER"
    fi
done
