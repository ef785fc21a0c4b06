#!/usr/bin/env python3
"""Whole sorts of the builds or settings to compare, run in the order given
(so that A and B take turns on the same machine), each timed and checked as
`h200_sort_vs_ks4.py` does (wall, peak memory, stage times, hashes of the
Phy files).

Usage: sort_ab.py OUT SPEC... with SPEC = name:binary:backend:threads[:K=V,K=V]
(threads 0: spikecube's default; K=V are environment settings, and ARGS=...
adds command-line arguments, e.g. ARGS=--keep-windows-gb=40). Needs the
simulation `h200_sort_vs_ks4.py` makes (/tmp/sim); writes OUT/results.json
after every run and each run's log tail as OUT/log_<name>.txt.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import h200_sort_vs_ks4 as h  # noqa: E402

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
work = Path('/tmp/sc_runs')
work.mkdir(exist_ok=True)
runs = []
for spec in sys.argv[2:]:
    parts = spec.split(':', 4)
    name, binary, backend, threads = parts[:4]
    env = dict(e.split('=', 1) for e in parts[4].split(',')) if len(parts) > 4 and parts[4] else {}
    r = h.sort_run(binary, name, backend, int(threads) if threads != '0' else None, env, work)
    runs.append(r)
    json.dump(dict(runs=runs), open(out / 'results.json', 'w'), indent=1)
    log = work / f'log_{name}.txt'
    if log.exists():
        (out / f'log_{name}.txt').write_text(log.read_text()[-20000:])
