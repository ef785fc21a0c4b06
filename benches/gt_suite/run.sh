#!/usr/bin/env bash
# Ground-truth suite, one device call: for each recording (spikecube simulate,
# SpikeInterface generate_ground_truth_recording, SpikeInterface
# generate_drifting_recording; 384 sites, 300 s), make it, sort it with
# Kilosort4 4.1.7 (run_kilosort, default settings) and with `spikecube sort`,
# score both against the truth (SpikeInterface compare_sorter_to_ground_truth,
# exhaustive, 0.4 ms). Every step is timed. See README.md beside this file.
#
# Usage (repository root): benches/gt_suite/run.sh
# Environment (defaults in brackets):
#   GT_SIZE      full (300 s, 150 units, 384 sites) | tiny (10 s, 20 units,
#                64 sites: a local check of the plumbing, Kilosort4 on a CPU) [full]
#   GT_SECONDS, GT_UNITS, GT_CHANNELS   override the size's length, units, sites
#   GT_RECS      recordings, comma-separated [sim,si_gt,si_drift]
#   GT_SORTERS   sorters, comma-separated [ks4,spikecube]
#   GT_BUDGET_S  wall budget of the whole call; each step may use what is left
#                of it less GT_RESERVE_S (for packing); a step that would get
#                less than 30 s is skipped [570]
#   GT_RESERVE_S [15]
#   GT_JOBS      workers of SpikeInterface's writing [16]
#   GT_DEVICE    Kilosort4's torch device [cuda]
#   GT_BACKEND   spikecube's --backend [cuda]
#   GT_WORK      scratch folder for recordings and sorter outputs (not returned) [/tmp/gt]
#   OUT          results folder [$GT_WORK/out]
#   PYTHON       [python3]
#   GT_SITE      Python packages: a folder to put first on PYTHONPATH, or
#                "none" for PYTHON's own [benches/gt_suite/carry/site.tar.xz,
#                unpacked into $GT_WORK/site]
#   SPIKECUBE    the binary [benches/gt_suite/carry/spikecube.xz, unpacked
#                into $GT_WORK/spikecube; without it target/release/spikecube]
#
# Results in $OUT (5 files): gt_suite.log (everything printed), scores.json
# (per recording and sorter, all units and 'good' units), summary.txt (one
# line each), timings.tsv (recording, step, seconds, exit status: 124 = out
# of budget) and gt_results.tar.gz (per recording: meta.json, the sorters'
# reports and Kilosort4's log, the spike trains of the truth and of each
# sorting in compact npz form, score.py --pack, and si_drift's true motion).
set -uo pipefail

# The whole script is one function, read completely before it runs: an edit
# of this file during a run cannot change that run.
main() {
    local t_start here root size seconds units channels recs sorters budget reserve jobs device backend work out py
    t_start=$(now_ms)
    here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
    root=$(cd "$here/../.." && pwd)
    size=${GT_SIZE:-full}
    case $size in
        full) seconds=300; units=150; channels=384 ;;
        tiny) seconds=10; units=20; channels=64 ;;
        *) echo "GT_SIZE must be full or tiny" >&2; return 2 ;;
    esac
    seconds=${GT_SECONDS:-$seconds}
    units=${GT_UNITS:-$units}
    channels=${GT_CHANNELS:-$channels}
    recs=${GT_RECS:-sim,si_gt,si_drift}
    sorters=${GT_SORTERS:-ks4,spikecube}
    budget=${GT_BUDGET_S:-570}
    reserve=${GT_RESERVE_S:-15}
    jobs=${GT_JOBS:-16}
    device=${GT_DEVICE:-cuda}
    backend=${GT_BACKEND:-cuda}
    work=${GT_WORK:-/tmp/gt}
    out=${OUT:-$work/out}
    py=${PYTHON:-python3}
    T_START=$t_start BUDGET=$budget RESERVE=$reserve TIMINGS="$out/timings.tsv"
    mkdir -p "$work/pack" "$out"
    exec > >(tee -a "$out/gt_suite.log") 2>&1
    export PYTHONUNBUFFERED=1
    local util="$here/suite_util.py"
    printf 'recording\tstep\tseconds\tstatus\n' > "$TIMINGS"

    echo "gt suite: size $size ($seconds s, $units units, $channels sites), recordings $recs, sorters $sorters, budget $budget s"
    echo "host: $(hostname), $(nproc) cores; $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo 'no nvidia-smi')"

    local site=${GT_SITE:-}
    if [ -z "$site" ]; then
        site="$work/site"
        step setup unpack_site "$py" "$util" untar "$here/carry/site.tar.xz" "$site" || return 1
    fi
    if [ "$site" != none ]; then
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    local sc=${SPIKECUBE:-}
    if [ -z "$sc" ]; then
        if [ -f "$here/carry/spikecube.xz" ]; then
            sc="$work/spikecube"
            step setup unpack_spikecube "$py" "$util" unxz "$here/carry/spikecube.xz" "$sc" || return 1
        else
            sc="$root/target/release/spikecube"
        fi
    fi
    echo "spikecube: $sc ($("$sc" --version 2>&1))"
    step setup imports "$py" "$util" versions || return 1

    # Each recording's scoring runs in the background while the next
    # recording is made (both on the CPU; the sorts, which are timed for
    # comparison, never overlap anything).
    local rec rdir nchan fs s specs scoring="" scored_dirs=()
    for rec in ${recs//,/ }; do
        rdir="$work/rec/$rec"
        rm -rf "$rdir" "$work/ks4/$rec" "$work/sc/$rec" "$work/pack/$rec"
        step "$rec" make "$py" "$here/make_recordings.py" "$work/rec" "$rec" --seconds "$seconds" \
            --n-units "$units" --n-channels "$channels" --n-jobs "$jobs" --spikecube "$sc"
        local made=$?
        finish_scoring
        [ $made = 0 ] || continue
        nchan=$("$py" "$util" field "$rdir/meta.json" n_chan_bin)
        fs=$("$py" "$util" field "$rdir/meta.json" fs)
        mkdir -p "$work/pack/$rec" "$work/ks4/$rec" "$work/sc/$rec"
        cp "$rdir/meta.json" "$work/pack/$rec/meta.json"
        cp "$rdir/drift_truth.npz" "$work/pack/$rec/drift_truth.npz" 2>/dev/null
        specs=()
        for s in ${sorters//,/ }; do
            case $s in
                ks4)
                    step "$rec" ks4 "$py" "$here/run_ks4.py" "$rdir/rec.bin" "$rdir/probe.json" "$nchan" "$fs" \
                        "$work/ks4/$rec/out" "$work/ks4/$rec/spikes.npz" --device "$device"
                    cp "$work/ks4/$rec/spikes.json" "$work/pack/$rec/ks4.json" 2>/dev/null
                    cp "$work/ks4/$rec/out/kilosort4.log" "$work/pack/$rec/ks4.log" 2>/dev/null
                    specs+=("ks4=$work/ks4/$rec/spikes.npz")
                    ;;
                spikecube)
                    step "$rec" spikecube "$sc" sort "$rdir/rec.bin" --n-channels "$nchan" --fs "$fs" \
                        --dtype int16 --probe "$rdir/probe.json" --backend "$backend" --out "$work/sc/$rec/out" \
                        -q --json > "$work/pack/$rec/spikecube.json"
                    cp "$work/sc/$rec/out/spikecube.json" "$work/pack/$rec/spikecube_manifest.json" 2>/dev/null
                    specs+=("spikecube=$work/sc/$rec/out")
                    ;;
                *) echo "unknown sorter $s" ;;
            esac
        done
        # Free the disk: the recording is not returned; the sorter folders go
        # once scored (gt.npz, meta.json and Kilosort4's spikes.npz stay).
        rm -rf "$rdir/rec.bin" "$rdir/spikecube_sim"
        step "$rec" score "$py" "$here/score.py" "$rdir" "$out/scores.json" --pack "$work/pack" "${specs[@]}" &
        scoring=$!
        scored_dirs=("$work/ks4/$rec/out" "$work/sc/$rec/out")
    done
    finish_scoring

    "$py" "$util" summary "$out/scores.json" "$out/summary.txt"
    cp "$TIMINGS" "$work/pack/timings.tsv"
    tar -C "$work/pack" -czf "$out/gt_results.tar.gz" .
    ls -l "$out"
    echo "gt suite done in $(secs $(( $(now_ms) - T_START ))) s"
}

# Waits for the background scoring (main's $scoring), then removes the
# sorter folders it read (main's $scored_dirs).
finish_scoring() {
    if [ -n "$scoring" ]; then
        wait "$scoring"
        scoring=""
        rm -rf "${scored_dirs[@]}"
    fi
}

now_ms() { echo $(( $(date +%s%N) / 1000000 )); }
secs() { printf '%d.%03d' $(( $1 / 1000 )) $(( $1 % 1000 )); } # milliseconds -> seconds

# step REC NAME CMD...: runs CMD with what is left of the budget as its
# time limit, records its wall time and exit status in $TIMINGS.
step() {
    local rec=$1 name=$2; shift 2
    local left=$(( BUDGET - RESERVE - ($(now_ms) - T_START) / 1000 ))
    if [ "$left" -lt 30 ]; then
        echo "== $rec $name: skipped, $left s left of the budget" >&2
        printf '%s\t%s\t\tskipped\n' "$rec" "$name" >> "$TIMINGS"
        return 99
    fi
    echo "== $rec $name (at $(secs $(( $(now_ms) - T_START ))) s, limit $left s): $*" >&2
    local t0 dt rc
    t0=$(now_ms)
    timeout --kill-after=5 "$left" "$@"
    rc=$?
    dt=$(secs $(( $(now_ms) - t0 )))
    printf '%s\t%s\t%s\t%s\n' "$rec" "$name" "$dt" "$rc" >> "$TIMINGS"
    echo "== $rec $name: exit $rc, $dt s" >&2
    return $rc
}

main "$@"
exit
