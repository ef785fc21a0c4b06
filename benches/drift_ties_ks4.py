"""Kilosort4 4.1.7's drift-corrected second pass, exported window by window
("every difference explained"; see benches/drift_ties.py).

Runs Kilosort4's `compute_preprocessing` and `compute_drift_correction`
(built-in templates, nblocks = 1) on a `spikecube simulate` recording, then its
second detection pass (`spikedetect.run`) on the drift-corrected reader, and
writes, for every batch b, the window that pass detected in (the drift-corrected
whitened window, float32 sites × (batch + 2·nt)) as `ks_X_<b>.npy`, and what
`template_match` returned on it (`ks_xy_<b>.npy`, `ks_imax_<b>.npy`,
`ks_amp_<b>.npy`); the same for the first (uncorrected) pass with the prefix
`ks1_`. Also: `st.npy` (the pass's st),
`dshift.npy`, `yblk.npy`, `iC.npy`, `iC2.npy`, `weigh.npy` (its neighbourhoods,
for `detect-window --neighbourhoods`), `meta.json`.

Usage (ks4ref venv; PYTHONPATH holds the ks4ref tools for ks4common):
    OMP_NUM_THREADS=1 python drift_ties_ks4.py SIM_DIR OUT_DIR [BATCH_SIZE]
"""
import json
import sys
import time
from pathlib import Path

import numpy as np
import ks4common  # noqa: F401  (KILOSORT_LOCAL_DOWNLOADS_PATH before kilosort loads)
import torch
from kilosort import io, spikedetect
from kilosort.parameters import DEFAULT_SETTINGS
from kilosort.run_kilosort import initialize_ops, compute_preprocessing, compute_drift_correction

CPU = torch.device('cpu')


def main():
    sim, out = Path(sys.argv[1]), Path(sys.argv[2])
    batch = int(sys.argv[3]) if len(sys.argv) > 3 else 30000
    out.mkdir(parents=True, exist_ok=True)
    probe = io.load_probe(sim / 'probe.json')
    rec = sim / 'sim_g0_t0.imec0.ap.bin'
    n_chan_bin = int(json.load(open(sim / 'probe.json'))['n_chan'])
    s = dict(DEFAULT_SETTINGS)
    s.update(n_chan_bin=n_chan_bin, fs=30000.0, templates_from_data=False, nblocks=1,
             batch_size=batch, filename=[rec])
    ops, s = initialize_ops(s, probe, 'int16', True, False, CPU, False)
    ops['filename'] = [rec]
    # Capture both detection passes' windows and template_match's results by
    # wrapping the calls: spikedetect.run (once per pass; datashift.run makes
    # the first) and template_match, which it calls once per batch with the
    # window. Files of the first pass start with ks1_, the second's with ks_.
    run, match = spikedetect.run, spikedetect.template_match
    state = {'pass': 0}

    def wrapped_run(*a, **k):
        state['pass'] += 1
        state['b'] = 0
        return run(*a, **k)

    def captured(X, *a, **k):
        xy, imax, amp, adist = match(X, *a, **k)
        pre, b = ('ks1' if state['pass'] == 1 else 'ks'), state['b']
        np.save(out / f'{pre}_X_{b}.npy', X.cpu().numpy().astype(np.float32))
        np.save(out / f'{pre}_xy_{b}.npy', xy.cpu().numpy().astype(np.int64))
        np.save(out / f'{pre}_imax_{b}.npy', imax.cpu().numpy().astype(np.int64))
        np.save(out / f'{pre}_amp_{b}.npy', amp.cpu().numpy().astype(np.float32))
        state['b'] += 1
        return xy, imax, amp, adist

    spikedetect.run, spikedetect.template_match = wrapped_run, captured
    t0 = time.perf_counter()
    ops = compute_preprocessing(ops, CPU)
    np.random.seed(1); torch.random.manual_seed(1)
    ops, bfile, st0 = compute_drift_correction(ops, CPU)
    t1 = time.perf_counter()
    print(f'first pass {len(st0)} spikes, {ops["Nbatches"]} batches, {t1 - t0:.1f} s', flush=True)
    st, _, ops = spikedetect.run(ops, bfile, device=CPU)
    t2 = time.perf_counter()
    np.save(out / 'st.npy', st)
    np.save(out / 'st0.npy', st0)
    np.save(out / 'dshift.npy', np.asarray(ops['dshift'], dtype=np.float64))
    np.save(out / 'yblk.npy', np.asarray(ops['yblk'], dtype=np.float64))
    for k in ('iC', 'iC2', 'weigh'):
        v = ops[k]
        v = v.cpu().numpy() if torch.is_tensor(v) else np.asarray(v)
        np.save(out / f'{k}.npy', v.astype(np.float32) if k == 'weigh' else v.astype(np.int64))
    json.dump({'batch_size': batch, 'nt': int(ops['nt']), 'n_batches': int(ops['Nbatches']),
               'first_pass_spikes': int(len(st0)), 'second_pass_spikes': int(len(st)),
               'first_pass_s': t1 - t0, 'second_pass_s': t2 - t1},
              open(out / 'meta.json', 'w'), indent=1)
    print(f'second pass {len(st)} spikes in {t2 - t1:.1f} s', flush=True)


if __name__ == '__main__':
    main()
