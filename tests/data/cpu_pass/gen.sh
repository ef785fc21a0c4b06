#!/bin/sh
# Usage: gen.sh SPIKECUBE_BINARY WORKDIR  — writes expected.json's content on stdout.
set -e
B=$1; W=$2
python3 - "$W" <<'PY'
import json, sys
w = sys.argv[1]
xc = [32.0 * (i % 2) for i in range(32)]; yc = [20.0 * (i // 2) for i in range(32)]
json.dump({"chanMap": list(range(32)), "xc": xc, "yc": yc, "kcoords": [0]*32, "n_chan": 32}, open(w + "/probe32.json", "w"))
PY
$B simulate -q --probe $W/probe32.json --seconds 6 --n-units 16 --rate 40 --seed 5 --out $W/sim32 >&2
$B simulate -q --seconds 4.2 --n-units 12 --rate 8 --seed 6 --out $W/sim384 >&2
$B detect -q $W/sim32/sim_g0_t0.imec0.ap.bin --out $W/a --threads 2 --nblocks 0 --templates-from-data false >&2
$B detect -q $W/sim32/sim_g0_t0.imec0.ap.bin --out $W/b --threads 2 --nblocks 0 --min-learn-clips 100 >&2
$B detect -q $W/sim384/sim_g0_t0.imec0.ap.bin --out $W/c --threads 2 --nblocks 0 --templates-from-data false >&2
python3 - "$W" <<'PY'
import json, os, sys
w = sys.argv[1]
def fnv(p):
    h = 0xcbf29ce484222325
    for b in open(p, 'rb').read():
        h ^= b; h = (h * 0x100000001b3) & 0xffffffffffffffff
    return '%016x' % h
out = {}
for run in 'abc':
    d = os.path.join(w, run)
    out[run] = {f: fnv(os.path.join(d, f)) for f in sorted(os.listdir(d)) if f.endswith(".npy")}
print(json.dumps(out, indent=1, sort_keys=True))
PY
