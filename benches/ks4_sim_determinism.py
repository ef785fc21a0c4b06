#!/usr/bin/env python3
"""Whether Kilosort4's reference simulation (`sort_h200.py`'s `simulate`) writes
the same recording twice: runs it four times in one process, twice as it is
and twice with `torch.use_deterministic_algorithms(True)`, and prints each
rec.bin's hash and time. On CUDA the first two differ (its `index_add_` sums
overlapping spikes with unordered atomics); the last two agree.

Usage: ks4_sim_determinism.py SORT_H200_PY [OUT_BIN]   (OUT_BIN: /tmp/simdet.bin)
Needs torch; about 35 s a run on an H100 (10 minutes, 384 sites, 400 units).
"""
import hashlib
import sys
import time
from pathlib import Path


def sha1(path):
    h = hashlib.sha1()
    with open(path, 'rb') as f:
        for block in iter(lambda: f.read(1 << 24), b''):
            h.update(block)
    return h.hexdigest()[:16]


def main():
    script = Path(sys.argv[1]).resolve()
    out = sys.argv[2] if len(sys.argv) > 2 else '/tmp/simdet.bin'
    sys.argv = [str(script), '/tmp/ks4_unused', '600', '400']
    sys.path.insert(0, str(script.parent))
    import torch
    import sort_h200 as s
    for deterministic in (False, False, True, True):
        torch.use_deterministic_algorithms(deterministic)
        t0 = time.time()
        s.simulate(out)
        print(f'deterministic={deterministic}: {sha1(out)} ({time.time() - t0:.1f} s)', flush=True)


if __name__ == '__main__':
    main()
