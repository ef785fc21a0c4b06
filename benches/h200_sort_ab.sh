#!/usr/bin/env bash
# Whole sorts of two builds of spikecube in one device call, in turn, on the
# 400-unit simulation of Kilosort4's reference script (the recording of
# BENCHMARKS.md's whole-sort rows), with the variants given as environment
# settings of the new build. Prints, per run, the whole-process wall, the
# sort's stage seconds, the detection's parts (warm-up, whitening fit,
# template learning, drift passes, the second pass's reading and checks) and
# the clusterings' profiles; then whether every run wrote the same bytes as
# the first.
#
# Usage: benches/h200_sort_ab.sh OLD_BINARY NEW_BINARY [SORT_H200_PY] [VARIANT...]
#   SORT_H200_PY: ../shared/tools/ks4ref/sort_h200.py by default (its
#   `simulate`, 10 minutes, 384 sites, 400 units, is written to $SIM).
#   VARIANT: NAME=ENV[,ENV...] runs of the new build with those settings,
#   e.g. min8k=SPIKECUBE_SEED_DEVICE_MIN=8000 readers2=SPIKECUBE_READERS=2.
# Environment: SIM (default /tmp/sim), WORK (default /tmp/sort_ab),
# BACKEND (default cuda), ROUNDS (default 2: old, new and each variant in
# turn, after one warm-up run of each build that compiles its kernels).
set -euo pipefail
old=$1
new=$2
ks4py=${3:-../shared/tools/ks4ref/sort_h200.py}
shift $(( $# < 3 ? $# : 3 ))
sim=${SIM:-/tmp/sim}
work=${WORK:-/tmp/sort_ab}
backend=${BACKEND:-cuda}
rounds=${ROUNDS:-2}
mkdir -p "$sim" "$work"
if [ ! -f "$sim/sim.bin" ]; then
    python3 - "$ks4py" "$sim" <<'PY'
import json, sys
from pathlib import Path
import numpy as np
script, sim = Path(sys.argv[1]).resolve(), Path(sys.argv[2])
sys.path.insert(0, str(script.parent))
sys.argv = [str(script), '/tmp/sort_ab_ks4_unused', '600', '400']
import sort_h200 as s
probe, times, units, info = s.simulate(sim / 'sim.bin')
json.dump({k: (np.asarray(v).tolist() if hasattr(v, '__len__') else v) for k, v in probe.items()},
          open(sim / 'probe.json', 'w'))
np.savez_compressed(sim / 'gt.npz', times=times, units=units)
print('simulated', times.size, 'spikes')
PY
fi
run() { # name binary [ENV=VALUE ...]
    local name=$1 bin=$2
    shift 2
    rm -rf "$work/o_$name"
    local t0 t1
    t0=$(date +%s%N)
    env SPIKECUBE_CLUSTER_PROFILE=1 "$@" "$bin" sort "$sim/sim.bin" --n-channels 384 --fs 30000 \
        --dtype int16 --probe "$sim/probe.json" --json --backend "$backend" \
        --out "$work/o_$name" >"$work/log_$name.txt" 2>&1
    t1=$(date +%s%N)
    echo "$name: whole process $(( (t1 - t0) / 1000000 )) ms $(grep -o '"timings_s":{[^}]*}' "$work/log_$name.txt")"
    grep -E "clustering profile: [0-9]+ groups|matching pass:" "$work/log_$name.txt" | sed 's/.*INFO /   /'
    python3 - "$work/o_$name/spikecube.json" <<'PY'
import json, sys
t = json.load(open(sys.argv[1]))['detection']['timings_s']
keys = ['device_warm_up', 'whitening_fit', 'templates', 'drift_first_pass', 'drift_estimate',
        'templates_second_pass', 'stages_wall', 'read', 'checks.prepare', 'upload', 'device',
        'drift_correct', 'write', 'overlap', 'total']
print('   detection:', ' '.join(f'{k} {t.get(k, 0):.2f}' for k in keys))
PY
}
variants=("$@")
run warm_old "$old"
run warm_new "$new"
names=()
for r in $(seq "$rounds"); do
    run "old$r" "$old"; names+=("old$r")
    run "new$r" "$new"; names+=("new$r")
    for v in "${variants[@]}"; do
        vname=${v%%=*}
        IFS=, read -r -a envs <<<"${v#*=}"
        run "$vname$r" "$new" "${envs[@]}"; names+=("$vname$r")
    done
done
for f in spike_times.npy spike_clusters.npy amplitudes.npy pc_features.npy templates.npy similar_templates.npy; do
    for n in "${names[@]}"; do
        cmp -s "$work/o_warm_new/$f" "$work/o_$n/$f" || echo "$f: $n differs from warm_new"
    done
done
echo "outputs compared with warm_new"
