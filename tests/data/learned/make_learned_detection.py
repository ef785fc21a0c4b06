"""Writes tests/data/learned/detection/: Kilosort4 4.1.7's detection with the templates
it learned from the recording (templates_from_data=True), on a few of its whitened windows.

Run with the Kilosort4 venv (CPU torch), from the repository root:

    spikecube simulate --probe data/probes/openephys_16ch_linear.json --seconds 60 \
        --seed 7 --n-units 30 --rate 15 --out SIM
    python tests/data/learned/make_learned_detection.py SIM/sim_g0_t0.imec0.ap.bin \
        SIM/probe.json 17 30000 2000 0,899 [WHOLE.npz]

Kilosort4's own steps, as run_kilosort does with templates_from_data=True, nblocks=0 and
batch_size 2000: initialize_ops -> compute_preprocessing -> numpy/torch seeded with 1 ->
compute_drift_correction (nothing with nblocks 0) -> spikedetect.run, which learns
wTEMP/wPCA from every 25th whitened window (extract_wPCA_wTEMP) and detects on every
window. Captured inside that call, for the windows listed (batch indices): the padded
whitened window X that template_match received, what template_match and yweighted
returned, and the rows of st and tF that run wrote for that batch. For each kept window
template_match is then called once more on the same X with the same ops, recording the
(Nf, NT) buffers it allocates with torch.zeros (as make_fixtures.py of the ks4ref tools
does): its signed best-filter index gives `sign`, and its outputs must equal the
captured ones.

Writes (under tests/data/learned/detection/):
  wTEMP.npz          Kilosort4's learned wTEMP (6 x 61) and wPCA (6 x 61), float32, in
                     the layout of Kilosort4's wTEMP.npz (np.savez: keys wTEMP, wPCA)
  probe.json         the recording's probe
  iC.npy iC2.npy weigh.npy xcup.npy ycup.npy   Kilosort4's neighbourhoods (ops)
  batch_<b>/X.npy    float32 (n_chan, batch_size + 122)
  batch_<b>/{xy,imax,amp,adist,yct,tF,st,sign}.npy   as in tests/data/fixtures/detection
                     (st: Kilosort4's spike table rows of that batch, time in seconds
                     from the start of the recording; sign from Kilosort4's buffer)
  meta.json          versions, settings, clip count, detection counts
WHOLE.npz (optional, not committed): st0 of the whole recording and the learned templates.
"""
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import kilosort
from kilosort import io, spikedetect
from kilosort.parameters import DEFAULT_SETTINGS
from kilosort.run_kilosort import (compute_drift_correction, compute_preprocessing,
                                   initialize_ops)

HERE = Path(__file__).resolve().parent
OUT = HERE / 'detection'


class ZerosRecorder:
    """Stands in for the torch module inside kilosort.spikedetect and keeps every
    tensor made with torch.zeros (template_match fills its buffers in place)."""

    def __init__(self):
        self.created = []

    def zeros(self, *a, **k):
        t = torch.zeros(*a, **k)
        self.created.append(t)
        return t

    def __getattr__(self, name):
        return getattr(torch, name)


def main():
    rec, probe_path, n_chan_bin, fs, batch_size, keep = sys.argv[1:7]
    whole = sys.argv[7] if len(sys.argv) > 7 else None
    keep = [int(b) for b in keep.split(',')]
    dev = torch.device('cpu')
    s = dict(DEFAULT_SETTINGS)
    s.update(n_chan_bin=int(n_chan_bin), fs=float(fs), batch_size=int(batch_size),
             templates_from_data=True, nblocks=0, filename=[Path(rec)])
    probe = io.load_probe(probe_path)
    ops, s = initialize_ops(s, probe, 'int16', True, False, dev, False)
    ops['filename'] = [Path(rec)]
    ops = compute_preprocessing(ops, dev)
    np.random.seed(1)
    torch.random.manual_seed(1)
    ops, bfile, _ = compute_drift_correction(ops, dev)

    captured = {}
    state = {}
    orig_batch, orig_tm, orig_yw = bfile.padded_batch_to_torch, spikedetect.template_match, spikedetect.yweighted

    def batch(ibatch, ops=None):
        X = orig_batch(ibatch, ops)
        state['ibatch'], state['X'] = ibatch, X
        return X

    def tm(X, *a, **k):
        out = orig_tm(X, *a, **k)
        b = state['ibatch']
        if b in keep and X is state['X']:
            captured[b] = {'X': X.clone(), 'tm': [t.clone() for t in out]}
        return out

    def yw(*a, **k):
        out = orig_yw(*a, **k)
        b = state['ibatch']
        if b in captured and 'yct' not in captured[b]:
            captured[b]['yct'] = out.clone()
        return out

    bfile.padded_batch_to_torch = batch
    spikedetect.template_match, spikedetect.yweighted = tm, yw
    try:
        st, tF, ops = spikedetect.run(ops, bfile, device=dev)
    finally:
        spikedetect.template_match, spikedetect.yweighted = orig_tm, orig_yw
        bfile.padded_batch_to_torch = orig_batch

    # The clips the learning step pooled (same calls as extract_wPCA_wTEMP).
    n_clips = 0
    for j in range(0, bfile.n_batches, 25):
        n_clips += len(spikedetect.extract_snippets(
            bfile.padded_batch_to_torch(j, ops), nt=ops['nt'], twav_min=ops['nt0min'],
            Th_single_ch=s['Th_single_ch'], device=dev))

    OUT.mkdir(exist_ok=True)
    wTEMP, wPCA = ops['wTEMP'].numpy(), ops['wPCA'].numpy()
    np.savez(OUT / 'wTEMP.npz', wTEMP=wTEMP, wPCA=wPCA)
    shutil.copyfile(probe_path, OUT / 'probe.json')
    np.save(OUT / 'iC.npy', ops['iC'].numpy())
    np.save(OUT / 'iC2.npy', ops['iC2'].numpy())
    np.save(OUT / 'weigh.npy', ops['weigh'].numpy())
    np.save(OUT / 'xcup.npy', np.asarray(ops['xcup']))
    np.save(OUT / 'ycup.npy', np.asarray(ops['ycup']))
    counts = {}
    for b in keep:
        c = captured[b]
        X = c['X']
        xy, imax, amp, adist = [t.numpy() for t in c['tm']]
        rows = st[:, 4] == b
        assert rows.sum() == len(xy), (b, rows.sum(), len(xy))
        assert np.array_equal(st[rows, 5].astype(np.int64), xy[:, 0])
        # Once more, keeping template_match's buffers: sign of the winning filter.
        rec_t = ZerosRecorder()
        spikedetect.torch = rec_t
        try:
            again = orig_tm(X, ops, ops['iC'], ops['iC2'], ops['weigh'], device=dev)
        finally:
            spikedetect.torch = torch
        assert all(torch.equal(p, q) for p, q in zip(again, c['tm'])), 'template_match repeat differs'
        nf = ops['iC'].shape[1]
        bufs = [t for t in rec_t.created if tuple(t.shape) == (nf, X.shape[-1])]
        imax_signed = bufs[2].numpy()
        sign = np.sign(imax_signed[xy[:, 0], xy[:, 1]]).astype(np.int8)
        assert np.array_equal(np.abs(imax_signed[xy[:, 0], xy[:, 1]]) - 1, imax)
        d = OUT / f'batch_{b}'
        d.mkdir(exist_ok=True)
        np.save(d / 'X.npy', X.numpy())
        for name, v in [('xy', xy), ('imax', imax), ('amp', amp), ('adist', adist),
                        ('yct', c['yct'].numpy()), ('tF', tF[rows]), ('st', st[rows]),
                        ('sign', sign)]:
            np.save(d / f'{name}.npy', v)
        counts[b] = int(len(xy))
        print(f'batch {b}: {len(xy)} detections')
    import sklearn
    meta = {
        'kilosort': kilosort.__version__, 'torch': torch.__version__, 'numpy': np.__version__,
        'sklearn': sklearn.__version__,
        'recording': 'spikecube simulate --probe data/probes/openephys_16ch_linear.json '
                     '--seconds 60 --seed 7 --n-units 30 --rate 15',
        'settings': {'batch_size': int(batch_size), 'fs': float(fs), 'n_chan_bin': int(n_chan_bin),
                     'templates_from_data': True, 'nblocks': 0, 'Th_single_ch': s['Th_single_ch'],
                     'nt': ops['nt'], 'nt0min': ops['nt0min'], 'Th_universal': s['Th_universal'],
                     'numpy_seed': 1},
        'n_batches': int(bfile.n_batches), 'learning_clips': int(n_clips),
        'detections_per_kept_batch': counts, 'detections_whole_recording': int(len(st)),
    }
    (OUT / 'meta.json').write_text(json.dumps(meta, indent=1) + '\n')
    if whole:
        np.savez(whole, st0=st, wTEMP=wTEMP, wPCA=wPCA,
                 spike_times=np.round(st[:, 0] * float(fs)).astype(np.int64))
    print(f'{n_clips} learning clips, {len(st)} detections in all')


if __name__ == '__main__':
    main()
