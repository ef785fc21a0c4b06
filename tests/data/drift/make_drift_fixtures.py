"""Builds the drift-estimation fixtures of tests/drift.rs from Kilosort4 4.1.7.

For each simulated drifting recording (made with `spikecube simulate --drift`,
see README.md here) this runs Kilosort4's own `compute_preprocessing` and
`compute_drift_correction` on the CPU (templates_from_data=False, nblocks=1,
batch_size 15000) and then, on the first-pass spikes `st0` it returned,
Kilosort4's `datashift.bin_spikes` and `datashift.align_block2` for nblocks
3 and 5, and `preprocessing.get_drift_matrix` for one window.

Usage: python make_drift_fixtures.py SIM_DIR CASE_NAME OUT_ROOT [--matrix] [--second-pass OUT.npy]
(KS4REF_VENV / ks4common.py from the ks4ref tools must be importable: PYTHONPATH=<ks4ref>).
"""
import copy
import os
import json
import sys
import time
from pathlib import Path

import numpy as np
import ks4common  # noqa: F401  (sets KILOSORT_LOCAL_DOWNLOADS_PATH before kilosort loads)
import torch
from kilosort import io, datashift, preprocessing, spikedetect
from kilosort.parameters import DEFAULT_SETTINGS
from kilosort.run_kilosort import initialize_ops, compute_preprocessing, compute_drift_correction

CPU = torch.device('cpu')
BATCH = int(os.environ.get("KS_BATCH", 7500))  # batch_size (samples)


def main():
    sim, case, out_root = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    out = out_root / case
    out.mkdir(parents=True, exist_ok=True)
    probe = io.load_probe(sim / 'probe.json')
    rec = sim / 'sim_g0_t0.imec0.ap.bin'
    n_chan_bin = int(json.load(open(sim / 'probe.json'))['n_chan'])
    s = dict(DEFAULT_SETTINGS)
    s.update(n_chan_bin=n_chan_bin, fs=30000.0, templates_from_data=False, nblocks=1,
             batch_size=BATCH, filename=[rec])
    ops, s = initialize_ops(s, probe, 'int16', True, False, CPU, False)
    ops['filename'] = [rec]
    t0 = time.perf_counter()
    ops = compute_preprocessing(ops, CPU)
    np.random.seed(1); torch.random.manual_seed(1)
    t1 = time.perf_counter()
    ops, bfile, st0 = compute_drift_correction(ops, CPU)
    t2 = time.perf_counter()
    print(f'{case}: {len(st0)} first-pass spikes, {ops["Nbatches"]} batches; '
          f'preprocessing {t1 - t0:.1f} s, drift (first pass + estimate) {t2 - t1:.1f} s', flush=True)

    # Only the columns the drift step reads: y (µm), amplitude, batch. All three
    # are exact in float32 (y and amplitude were float32 in Kilosort).
    cols = st0[:, [1, 2, 4]]
    assert np.all(cols.astype(np.float32).astype(np.float64) == cols)
    np.save(out / 'st0.npy', cols.astype(np.float32))
    F, ysamp = datashift.bin_spikes(ops, st0)
    nz = np.nonzero(F)
    np.save(out / 'F_index.npy', np.stack(nz, axis=1).astype(np.int32))
    np.save(out / 'F_value.npy', F[nz])
    np.save(out / 'F_shape.npy', np.array(F.shape, dtype=np.int64))
    np.save(out / 'ysamp.npy', ysamp)
    meta = {'n_spikes': int(len(st0)), 'n_batches': int(ops['Nbatches']), 'batch_size': BATCH,
            'binning_depth': float(ops['binning_depth']), 'Th_universal': float(ops['Th_universal']),
            'drift_smoothing': list(ops['drift_smoothing']), 'sig_interp': float(ops['settings']['sig_interp'])}
    for nb in (1, 3, 5):
        o = copy.copy(ops)
        o['nblocks'] = nb
        imin, yblk, _, _ = datashift.align_block2(F, ysamp, o, device=CPU)
        dshift = imin * ops['binning_depth']
        if nb == 1:
            assert np.array_equal(dshift, ops['dshift']), 'align_block2 differs from the run'
        np.save(out / f'dshift_nb{nb}.npy', np.asarray(dshift, dtype=np.float64))
        np.save(out / f'yblk_nb{nb}.npy', np.asarray(yblk, dtype=np.float64))
    if '--matrix' in sys.argv:
        np.save(out / 'iKxx.npy', ops['iKxx'].cpu().numpy().astype(np.float32))
        d1 = ops['dshift']
        b = int(np.argmax(np.abs(d1[:, 0])))
        np.save(out / 'M_nb1.npy', preprocessing.get_drift_matrix(ops, d1[b], CPU).cpu().numpy().astype(np.float32))
        o = copy.copy(ops)
        o['nblocks'] = 3
        o['yblk'] = np.load(out / 'yblk_nb3.npy')
        d3 = np.load(out / 'dshift_nb3.npy')
        b3 = int(np.argmax(np.ptp(d3, axis=1)))
        np.save(out / 'M_nb3.npy', preprocessing.get_drift_matrix(o, d3[b3], CPU).cpu().numpy().astype(np.float32))
        meta['matrix_batches'] = {'nb1': b, 'nb3': b3}
    json.dump(meta, open(out / 'meta.json', 'w'), indent=1)
    if '--second-pass' in sys.argv:
        # Kilosort4's second detection pass on the drift-corrected reader (for the
        # end-to-end measurement in BENCHMARKS.md; not a test fixture).
        st, _, ops = spikedetect.run(ops, bfile, device=CPU)
        t3 = time.perf_counter()
        np.save(sys.argv[sys.argv.index('--second-pass') + 1], st)
        print(f'{case}: second pass {len(st)} spikes in {t3 - t2:.1f} s', flush=True)


if __name__ == '__main__':
    main()
