#!/usr/bin/env bash
# The drift step's cost, measured as docs/benchmarks-history.md defines it (issue 12):
#
#   cost = [T(nblocks 1) − 2·T(nblocks 0) + T(fit)] / T(nblocks 0) = r − 2 + f
#   r = T(nblocks 1) / T(nblocks 0) (median over pairs),  f = T(fit) / T(nblocks 0)
#
# T: whole processes, wall seconds and CPU seconds (user + system), from
# /usr/bin/time. Each repeat runs `detect --nblocks 0`, `detect --nblocks 1`
# and the fit-only process in turn (pairs alternate, so that a machine whose
# speed drifts affects both alike); repeat 0 is a warm-up and is not counted.
# The fit-only process opens the recording and fits the whitening as `detect`
# does, then exits: the part of a run the drift step does not repeat. It is the
# bench binary drift_windows; build it with
#
#   cargo bench --no-default-features --bench drift_windows --no-run
#
# and give the path it prints ("Executable ... (target/release/deps/drift_windows-HASH)").
#
# Usage:
#   benches/drift_cost.sh SPIKECUBE REC.bin PROBE.json OUTDIR THREADS REPEATS FIT_BIN [BATCH_SIZE]
#
# e.g. (the recording of docs/benchmarks-history.md: spikecube simulate --seconds 60 --seed 5 --drift rigid --out /tmp/rec)
#   benches/drift_cost.sh target/release/spikecube /tmp/rec/sim_g0_t0.imec0.ap.bin \
#       /tmp/rec/probe.json /tmp/cost 16 4 target/release/deps/drift_windows-HASH
#
# Settings: `detect --templates-from-data false --backend cpu --threads THREADS`
# (RAYON_NUM_THREADS=THREADS for the fit). Writes OUTDIR/times.tsv (one line per
# process: repeat, kind, wall, user, sys, max RSS KiB) and keeps the outputs of
# the last repeat (OUTDIR/nb0, OUTDIR/nb1: spikecube.json holds per-stage
# timings). Prints the medians and the cost. Needs bash, awk and GNU time.
set -euo pipefail

if [ $# -lt 7 ]; then
    sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
SC=$1 REC=$2 PROBE=$3 OUT=$4 THREADS=$5 REPEATS=$6 FIT=$7 BATCH=${8:-60000}
TIME=/usr/bin/time
for f in "$SC" "$FIT"; do
    [ -x "$f" ] || { echo "drift_cost.sh: $f is not an executable file" >&2; exit 2; }
done
[ -f "$REC" ] || { echo "drift_cost.sh: no recording $REC" >&2; exit 2; }
[ -f "$PROBE" ] || { echo "drift_cost.sh: no probe $PROBE" >&2; exit 2; }
[ -x "$TIME" ] || { echo "drift_cost.sh: needs GNU time at $TIME" >&2; exit 2; }
case "$THREADS$REPEATS" in *[!0-9]*) echo "drift_cost.sh: THREADS and REPEATS are numbers" >&2; exit 2;; esac
[ "$REPEATS" -ge 1 ] || { echo "drift_cost.sh: REPEATS must be at least 1" >&2; exit 2; }

mkdir -p "$OUT"
TSV=$OUT/times.tsv
printf 'repeat\tkind\twall_s\tuser_s\tsys_s\tmaxrss_kib\n' >"$TSV"

# run REPEAT KIND COMMAND...: times one process, appends a line to times.tsv.
run() {
    local rep=$1 kind=$2
    shift 2
    local t=$OUT/.time
    if ! "$TIME" -f "%e %U %S %M" -o "$t" "$@" >"$OUT/$kind.log" 2>&1; then
        echo "drift_cost.sh: $kind (repeat $rep) failed; its output:" >&2
        tail -20 "$OUT/$kind.log" >&2
        exit 1
    fi
    read -r wall user sys rss <"$t"
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$rep" "$kind" "$wall" "$user" "$sys" "$rss" >>"$TSV"
    echo "repeat $rep $kind: wall $wall s, CPU $(awk -v u="$user" -v s="$sys" 'BEGIN{printf "%.2f", u + s}') s"
}

detect() {
    local rep=$1 nb=$2
    rm -rf "$OUT/nb$nb"
    run "$rep" "nb$nb" "$SC" detect "$REC" --probe "$PROBE" --out "$OUT/nb$nb" \
        --templates-from-data false --backend cpu --threads "$THREADS" \
        --batch-size "$BATCH" --nblocks "$nb" -q
}

for rep in $(seq 0 "$REPEATS"); do
    detect "$rep" 0
    detect "$rep" 1
    run "$rep" fit env RAYON_NUM_THREADS="$THREADS" "$FIT" fit "$REC" "$PROBE" - "$BATCH" -
done

# Medians over the counted repeats (1..REPEATS), paired ratios r, and the cost.
awk -F'\t' -v threads="$THREADS" '
function median(a, n,    i, j, t) {
    for (i = 2; i <= n; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] > t; j--) a[j + 1] = a[j]; a[j + 1] = t }
    return (n % 2) ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
}
NR > 1 && $1 > 0 {
    w[$2, $1] = $3; c[$2, $1] = $4 + $5; reps[$1] = 1
}
END {
    n = 0
    for (r in reps) n++
    split("wall CPU", names, " ")
    for (m = 1; m <= 2; m++) {
        k = 0
        for (r = 1; r <= n; r++) {
            k++
            v0 = (m == 1) ? w["nb0", r] : c["nb0", r]
            v1 = (m == 1) ? w["nb1", r] : c["nb1", r]
            vf = (m == 1) ? w["fit", r] : c["fit", r]
            a0[k] = v0; a1[k] = v1; af[k] = vf; ar[k] = v1 / v0
            if (k == 1 || ar[k] < rmin) rmin = ar[k]
            if (k == 1 || ar[k] > rmax) rmax = ar[k]
        }
        t0 = median(a0, k); t1 = median(a1, k); tf = median(af, k); r = median(ar, k)
        f = tf / t0
        printf "%-4s (%d threads, %d pairs): T(nb 0) %.2f s, T(nb 1) %.2f s, T(fit) %.2f s; r %.4f (%.4f-%.4f), f %.3f; cost = r - 2 + f = %.1f %%\n", \
            names[m], threads, k, t0, t1, tf, r, rmin, rmax, f, 100 * (r - 2 + f)
    }
}' "$TSV"
echo "times: $TSV; outputs of the last repeat: $OUT/nb0, $OUT/nb1"
