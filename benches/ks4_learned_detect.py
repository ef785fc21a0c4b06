"""Kilosort4 4.1.7's own detection with templates learned from the data (docs/benchmarks-history.md).

Usage (the Kilosort4 venv; see ../shared/tools/ks4ref/README.md for its set-up):

    OMP_NUM_THREADS=1 python benches/ks4_learned_detect.py REC.bin PROBE.json N_CHAN_BIN FS OUT.npz \
        [--dtype int16] [--ground-truth GROUND_TRUTH.npy] [--batches 0,6,12]

Runs Kilosort4's own steps as `run_kilosort` does with `templates_from_data=True` and
`nblocks=0`: `initialize_ops` -> `compute_preprocessing` -> numpy/torch seeded with 1 ->
`compute_drift_correction` (nothing to do with nblocks 0) -> `spikedetect.run`, which
learns wTEMP/wPCA from every 25th whitened window and then detects once on the
uncorrected data. On the CPU.

With `--batches`, `template_match` runs only on the batches listed (the others give no
detections; their windows are not read): Kilosort4's CPU detection takes minutes per
384 x 60 122 batch on a loaded 2-core machine. Learning is unchanged (it reads its own
windows). The recall is then counted against the true spikes of those batches only.
OUT.npz is rewritten after each detected batch (partial results are usable).

Writes OUT.npz: `spike_times` (int64 samples, sorted: each detection's sample in its
window − nt + batch · batch_size), `st0` (Kilosort4's spike table, when the run is
complete), `wTEMP`, `wPCA` (the learned templates, in
Kilosort4's wTEMP.npz layout, so OUT.npz can be given to `spikecube detect --templates`),
and timings. With the ground truth (trough sample in column 0, as `spikecube simulate`
writes it) it prints recall and precision the way benches/learned_vs_ks4.py does: a true
trough matched one-to-one, greedily in time, by a detection 10 samples later within
±15 samples.
"""
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from kilosort import io, spikedetect
from kilosort.parameters import DEFAULT_SETTINGS
from kilosort.run_kilosort import (compute_drift_correction, compute_preprocessing,
                                   initialize_ops)


def recall_precision(times, truth, spans=None):
    t = np.sort(times) - 10
    gt = np.sort(truth[:, 0])
    if spans is not None:
        # true spikes whose detection (trough + 10) falls in a detected batch
        keep = np.zeros(len(gt), bool)
        for lo, hi in spans:
            keep |= (gt + 10 >= lo) & (gt + 10 < hi)
        gt = gt[keep]
    used = np.zeros(len(t), bool)
    hit = 0
    for g in gt:
        lo, hi = np.searchsorted(t, g - 15), np.searchsorted(t, g + 15, 'right')
        for i in range(lo, hi):
            if not used[i]:
                used[i] = True
                hit += 1
                break
    return hit / max(len(gt), 1), used.sum() / max(len(t), 1), len(t)


def main():
    rec, probe_path, n_chan_bin, fs, out = sys.argv[1:6]
    arg = lambda k, d=None: sys.argv[sys.argv.index(k) + 1] if k in sys.argv else d
    dtype = arg('--dtype', 'int16')
    dev = torch.device('cpu')
    s = dict(DEFAULT_SETTINGS)
    s.update(n_chan_bin=int(n_chan_bin), fs=float(fs), templates_from_data=True, nblocks=0,
             filename=[Path(rec)])
    probe = io.load_probe(probe_path)
    ops, s = initialize_ops(s, probe, dtype, True, False, dev, False)
    ops['filename'] = [Path(rec)]
    t0 = time.perf_counter()
    ops = compute_preprocessing(ops, dev)
    # run_kilosort seeds here, just before the drift step.
    np.random.seed(1)
    torch.random.manual_seed(1)
    t1 = time.perf_counter()
    ops, bfile, _ = compute_drift_correction(ops, dev)
    batches = arg('--batches')
    batches = None if batches is None else [int(b) for b in batches.split(',')]
    bs, nt = int(ops['batch_size']), int(ops['nt'])
    gt = arg('--ground-truth')
    truth = np.load(gt) if gt else None
    state = {'learning': False, 'ibatch': None, 'times': [], 'done': []}
    orig_learn, orig_tm, orig_batch = (spikedetect.extract_wPCA_wTEMP,
                                       spikedetect.template_match, bfile.padded_batch_to_torch)

    def save(final=False, st0=None):
        times = np.sort(np.concatenate(state['times'])) if state['times'] else np.zeros(0, np.int64)
        extra = {} if st0 is None else {'st0': st0}
        np.savez(out, spike_times=times, wTEMP=state['wTEMP'], wPCA=state['wPCA'],
                 batches_detected=np.array(state['done'], np.int64),
                 preprocessing_s=t1 - t0, elapsed_s=time.perf_counter() - t1, **extra)
        r = {'n': int(len(times)), 'batches_detected': len(state['done']), 'final': final,
             'preprocessing_s': t1 - t0, 'learn_and_detect_s': time.perf_counter() - t1}
        if truth is not None:
            sp = None if batches is None else [(b * bs, (b + 1) * bs) for b in state['done']]
            r['recall_precision_n'] = recall_precision(times, truth, sp)
        print(json.dumps(r), flush=True)

    def learn(*a, **k):
        state['learning'] = True
        wPCA, wTEMP = orig_learn(*a, **k)
        state['learning'] = False
        state['wTEMP'], state['wPCA'] = wTEMP.numpy(), wPCA.numpy()
        save()
        return wPCA, wTEMP

    def batch(ibatch, ops=None):
        state['ibatch'] = int(ibatch)
        if not state['learning'] and batches is not None and ibatch not in batches:
            return torch.zeros((len(ops['chanMap']), bs + 2 * nt))
        return orig_batch(ibatch, ops)

    def tm(X, ops, iC, *a, **k):
        b = state['ibatch']
        if batches is not None and b not in batches:
            e = torch.zeros((0,), dtype=torch.int64)
            return (torch.zeros((0, 2), dtype=torch.int64), e, torch.zeros(0),
                    torch.zeros((iC.shape[0], 0)))
        xy, imax, amp, adist = orig_tm(X, ops, iC, *a, **k)
        state['times'].append(xy[:, 1].numpy().astype(np.int64) - nt + b * bs)
        state['done'].append(b)
        save()
        return xy, imax, amp, adist

    spikedetect.extract_wPCA_wTEMP, spikedetect.template_match = learn, tm
    bfile.padded_batch_to_torch = batch
    st0, _, _ = spikedetect.run(ops, bfile, device=dev)
    save(final=True, st0=st0)


if __name__ == '__main__':
    main()
