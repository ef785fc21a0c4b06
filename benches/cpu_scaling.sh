#!/usr/bin/env bash
# How the CPU back end's detection scales with threads on this machine: the
# processor layout (cores, threads per core, sockets, NUMA nodes), then
# `spikecube detect --backend cpu` (Kilosort4's default path: drift's first
# pass, then the corrected pass) on the first SECONDS of a recording with
# each thread count in turn, and per run the whole-process wall, user and
# system seconds, the cores kept busy ((user + system) / wall), peak memory
# and the detection's parts from its spikecube.json (the two passes, the
# pass's reading, checks, preprocessing and detection steps). A per-thread
# rate that falls while the busy cores stay near the thread count points at
# memory or at the cores' shared units; busy cores well below the thread
# count point at waits (serial steps, the pipeline's hand-offs).
#
# Usage: benches/cpu_scaling.sh BINARY REC [SECONDS] [THREADS...]
#   REC: a SpikeGLX .bin, or a flat int16 file with its probe.json beside it
#   (then 384 channels at 30 kHz are assumed, as sort_h200.py's simulation).
#   SECONDS: 60 by default; THREADS: 1 2 4 8 16 by default.
# Environment: WORK (default /tmp/cpu_scaling), ROUNDS (default 1).
set -euo pipefail
bin=$1
rec=$2
secs=${3:-60}
shift $(( $# < 3 ? $# : 3 ))
threads=("$@")
[ ${#threads[@]} -gt 0 ] || threads=(1 2 4 8 16)
work=${WORK:-/tmp/cpu_scaling}
rounds=${ROUNDS:-1}
mkdir -p "$work"
# timed TIME_FILE LOG_FILE COMMAND...: runs COMMAND with its output in
# LOG_FILE and writes "wall user sys peak_kB" to TIME_FILE (the child's
# rusage through wait4, so no GNU time is needed on the machine).
timed() {
    python3 - "$@" <<'PY'
import os, subprocess, sys, time
time_file, log_file, cmd = sys.argv[1], sys.argv[2], sys.argv[3:]
t0 = time.monotonic()
with open(log_file, 'w') as log:
    child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    _, status, ru = os.wait4(child.pid, 0)
wall = time.monotonic() - t0
open(time_file, 'w').write(f'{wall} {ru.ru_utime} {ru.ru_stime} {ru.ru_maxrss}\n')
sys.exit(os.waitstatus_to_exitcode(status))
PY
}
echo "== processors"
lscpu | grep -E "^(Model name|CPU\(s\)|Thread\(s\) per core|Core\(s\) per socket|Socket\(s\)|NUMA node\(s\)|L3 cache|Flags)" \
    | sed -E 's/^(Flags:).*/\1 (avx512f: '"$(grep -c avx512f /proc/cpuinfo)"' processors)/'
nproc
extra=()
if [[ "$rec" != *.bin ]] || [ ! -f "${rec%.bin}.meta" ]; then
    extra=(--n-channels 384 --fs 30000 --dtype int16 --probe "$(dirname "$rec")/probe.json")
fi
echo "== detect --backend cpu, first $secs s of $rec"
for r in $(seq "$rounds"); do
    for n in "${threads[@]}"; do
        out="$work/o_${n}_$r"
        rm -rf "$out"
        timed "$work/time_$n" "$work/log_$n.txt" \
            "$bin" detect "$rec" ${extra[@]+"${extra[@]}"} --tmax "$secs" --backend cpu --threads "$n" \
            --out "$out" -q
        python3 - "$n" "$secs" "$work/time_$n" "$out/spikecube.json" <<'PY'
import json, sys
n, secs = int(sys.argv[1]), float(sys.argv[2])
wall, user, sys_s, peak_kb = (float(v) for v in open(sys.argv[3]).read().split()[-4:])
t = json.load(open(sys.argv[4]))['timings_s']
busy = (user + sys_s) / wall
print(f'threads {n:3d}: wall {wall:7.2f} s ({secs / wall:5.1f}x realtime), user {user:7.1f} s, '
      f'sys {sys_s:6.1f} s, busy cores {busy:5.2f}, peak {peak_kb / 1e6:5.2f} GB')
keys = ['drift_first_pass', 'stages_wall', 'read', 'checks.prepare', 'preprocess', 'detect',
        'detect.check', 'detect.steps_1_3', 'detect.peaks', 'detect.features', 'overlap']
print('   ', ' '.join(f'{k} {t[k]:.2f}' for k in keys if k in t))
PY
    done
done
for n in "${threads[@]}"; do
    cmp -s "$work/o_${threads[0]}_1/spike_times.npy" "$work/o_${n}_1/spike_times.npy" \
        || echo "spike_times.npy: $n threads differ from ${threads[0]}"
done
echo "spike times compared across thread counts"
