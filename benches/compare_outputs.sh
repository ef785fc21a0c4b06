#!/usr/bin/env bash
# Byte-identity of two spikecube binaries' outputs (e.g. main's and a
# restructured branch's), on the CPU back end:
#   simulate (60 s, default probe) · detect with the built-in templates, drift
#   off (--nblocks 0) and on · detect with the default settings (templates learned from the
#   data, drift correction) · preprocess · detect-window (each fixture of
#   tests/data/fixtures/detection, with and without its neighbourhoods).
# Every file of every output folder is compared with cmp, except
# spikecube.json, whose timings and wall times differ from run to run: there
# its `timings_s` keys are compared, and everything else with the timings'
# values and the `wall`/`*_s` entries masked; and params.py, which names the
# recording's path (WORK/old/... against WORK/new/...): compared with that
# path made the same.
#
# Usage: benches/compare_outputs.sh OLD_BINARY NEW_BINARY [WORK_DIR]
# (SKIP_RUNS=1 compares the folders already in WORK_DIR.)
# Exits 1 at the first difference; prints one line per output compared.
set -euo pipefail
old=$1
new=$2
work=${3:-$(mktemp -d)}
mkdir -p "$work"
here=$(cd "$(dirname "$0")/.." && pwd)
fail=0

same_folder() { # label dirA dirB
    local label=$1 a=$2 b=$3
    local fa fb
    fa=$(cd "$a" && find . -type f | sort)
    fb=$(cd "$b" && find . -type f | sort)
    if [ "$fa" != "$fb" ]; then
        echo "DIFFERENT $label: file lists differ"; diff <(echo "$fa") <(echo "$fb") || true; fail=1; return
    fi
    local n=0 bad=$fail
    fail=0
    while read -r f; do
        case "$f" in
        */params.py)
            if ! cmp -s <(sed 's|/old/|/new/|g' "$a/$f") "$b/$f"; then
                echo "DIFFERENT $label: $f"; fail=1
            fi ;;
        */spikecube.json)
            if ! python3 "$here/benches/compare_spikecube_json.py" "$a/$f" "$b/$f"; then
                echo "DIFFERENT $label: $f"; fail=1
            fi ;;
        *)
            if ! cmp -s "$a/$f" "$b/$f"; then
                echo "DIFFERENT $label: $f"; fail=1
            fi ;;
        esac
        n=$((n + 1))
    done <<< "$fa"
    if [ $fail = 1 ]; then return; fi
    fail=$bad
    echo "same $label: $n files ($(cd "$a" && find . -name '*.npy' | wc -l) .npy; sha1 of all: $(cd "$a" && find . -type f ! -name spikecube.json | sort | xargs sha1sum | sha1sum | cut -c1-12))"
}

for v in old new; do
    [ "${SKIP_RUNS:-0}" = 1 ] && break
    bin=${!v}
    "$bin" -q simulate --seconds 60 --out "$work/$v/sim" >/dev/null
    "$bin" -q detect "$work/$v/sim/sim_g0_t0.imec0.ap.bin" --backend cpu --templates-from-data false --nblocks 0 --out "$work/$v/det_builtin" >/dev/null
    "$bin" -q detect "$work/$v/sim/sim_g0_t0.imec0.ap.bin" --backend cpu --templates-from-data false --out "$work/$v/det_builtin_drift" >/dev/null
    "$bin" -q detect "$work/$v/sim/sim_g0_t0.imec0.ap.bin" --backend cpu --out "$work/$v/det_default" >/dev/null
    "$bin" -q preprocess "$work/$v/sim/sim_g0_t0.imec0.ap.bin" --out "$work/$v/pre" >/dev/null
    for case in "$here"/tests/data/fixtures/detection/*/; do
        c=$(basename "$case")
        "$bin" -q detect-window --window "$case/X.npy" --probe "$case/probe.json" --neighbourhoods "$case" --backend cpu --out "$work/$v/dw_$c" >/dev/null
        "$bin" -q detect-window --window "$case/X.npy" --probe "$case/probe.json" --backend cpu --out "$work/$v/dw_own_$c" >/dev/null
    done
done
for d in $(cd "$work/old" && ls); do
    same_folder "$d" "$work/old/$d" "$work/new/$d"
done
if [ $fail = 0 ]; then echo "ALL IDENTICAL ($work)"; else echo "DIFFERENCES ($work)"; exit 1; fi
