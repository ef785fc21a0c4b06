"""Recall and drift-estimate error on simulated drifting recordings (docs/benchmarks-history.md, "Drift").

Usage: drift_recall.py SIM_DIR NAME=SPIKES [NAME=SPIKES ...]
  SIM_DIR: a `spikecube simulate --drift ...` folder (ground_truth.npy, drift_truth*.npy, probe.json)
  SPIKES: a spikecube output folder (spike_times.npy, and drift.npy/drift_blocks.npy when it
          corrected drift), or Kilosort4's st (.npy, n x 6, seconds in column 0) with
          DSHIFT.npy,YBLK.npy appended after commas, e.g. ks=st.npy,dshift.npy,yblk.npy
Recall: true spikes (trough + 10 samples, Kilosort4's detection time) matched one to one
within 0.5 ms. Drift error: the shift each method applies at each site (dshift interpolated
to the site's depth, as the correction does), sign-flipped, against the true displacement
at that depth at the window's centre; RMS over windows x sites after removing each site's mean over
time (the estimate is relative to the time-averaged template, so each depth's offset is free).
"""
import json, sys
from pathlib import Path
import numpy as np


def match(a, b, tol):
    a, b = np.sort(a), np.sort(b)
    i = j = m = 0
    while i < len(a) and j < len(b):
        d = a[i] - b[j]
        if abs(d) <= tol:
            m += 1; i += 1; j += 1
        elif d < 0:
            i += 1
        else:
            j += 1
    return m


def site_shifts(dshift, yblk, yc):
    if dshift.shape[1] == 1:
        return np.repeat(dshift[:, :1], len(yc), axis=1)
    out = np.empty((dshift.shape[0], len(yc)))
    for b in range(dshift.shape[0]):
        # linear with linear extrapolation at both ends
        j = np.clip(np.searchsorted(yblk, yc) - 1, 0, len(yblk) - 2)
        slope = (dshift[b, j + 1] - dshift[b, j]) / (yblk[j + 1] - yblk[j])
        out[b] = slope * (yc - yblk[j]) + dshift[b, j]
    return out


def main():
    sim = Path(sys.argv[1])
    gt = np.load(sim / 'ground_truth.npy')
    truth = np.load(sim / 'drift_truth.npy')
    tt = np.load(sim / 'drift_truth_times.npy')
    ty = np.load(sim / 'drift_truth_depths.npy')
    probe = json.load(open(sim / 'probe.json'))
    yc = np.asarray(probe['yc'], dtype=np.float64)
    fs = 30000.0
    true_t = gt[:, 0].astype(np.int64) + 10
    tol = int(round(0.5e-3 * fs))
    res = {}
    for arg in sys.argv[2:]:
        name, spec = arg.split('=', 1)
        parts = spec.split(',')
        p = Path(parts[0])
        dshift = yblk = None
        if p.is_dir():
            t = np.load(p / 'spike_times.npy')
            if (p / 'drift.npy').exists():
                dshift, yblk = np.load(p / 'drift.npy'), np.load(p / 'drift_blocks.npy')
            nwin_len = json.load(open(p / 'spikecube.json'))['settings']['preprocessing']['batch_size']
        else:
            st = np.load(p)
            t = np.round(st[:, 0] * fs).astype(np.int64)
            if len(parts) >= 3:
                dshift, yblk = np.load(parts[1]), np.load(parts[2])
            nwin_len = int(parts[3]) if len(parts) > 3 else 60000
        r = {'n': int(len(t)), 'recall': match(t, true_t, tol) / len(true_t),
             'precision': match(t, true_t, tol) / max(1, len(t))}
        if dshift is not None:
            nb = dshift.shape[0]
            tc = (np.arange(nb) + 0.5) * nwin_len / fs
            s = site_shifts(dshift, yblk, yc)              # windows x sites, µm (Kilosort4's sign)
            # true displacement (µm, up) at each window centre and site depth
            ti = np.clip(np.round(tc / (tt[1] - tt[0])).astype(int), 0, len(tt) - 1)
            d = np.stack([np.interp(yc, ty, truth[i]) for i in ti])
            err = -s - d
            err -= err.mean(axis=0, keepdims=True)
            r['drift_rms_um'] = float(np.sqrt((err ** 2).mean()))
            r['true_drift_sd_um'] = float((d - d.mean(axis=0, keepdims=True)).std())
        res[name] = r
        print(name, json.dumps(r), flush=True)


if __name__ == '__main__':
    main()
