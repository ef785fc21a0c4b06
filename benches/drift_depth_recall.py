"""Recall with a depth criterion (docs/benchmarks-history.md, "Drift", edge policy): is the recall gain of
drift correction with Kilosort4's extrapolation at the probe's end (edge margin inf) made of
false detections that match true spikes at other depths by chance?

Usage: drift_depth_recall.py SIM_DIR NAME=SPIKECUBE_OUT [NAME=KS_ST.npy,BATCH_SIZE,DSHIFT.npy ...]
(env DY: depth tolerance in µm, default 60). True spikes (trough + 10 samples) are matched one
to one in time within 0.5 ms (as drift_recall.py); a match also counts for the depth recall when
the detection's depth (spike_positions.npy column 1, or Kilosort4's st[:, 1]) lies within DY of
the true spike's depth moved into the corrected frame (+ dshift of its window)."""
import json, sys
from pathlib import Path
import numpy as np
sim = Path(sys.argv[1]); fs = 30000.0
gt = np.load(sim / 'ground_truth.npy')
probe = json.load(open(sim / 'probe.json')); yc = np.asarray(probe['yc']); ytop = yc.max()
tt = gt[:, 0].astype(np.int64) + 10; ty = gt[:, 2]
order = np.argsort(tt, kind='stable'); tt, ty = tt[order], ty[order]
tol = 15

def pairs(t):
    o = np.argsort(t, kind='stable'); ts = t[o]
    i = j = 0; out = []
    while i < len(ts) and j < len(tt):
        d = ts[i] - tt[j]
        if abs(d) <= tol: out.append((o[i], j)); i += 1; j += 1
        elif d < 0: i += 1
        else: j += 1
    return out

for arg in sys.argv[2:]:
    name, spec = arg.split('=', 1)
    parts = spec.split(',')
    p = Path(parts[0])
    if p.is_dir():
        t = np.load(p / 'spike_times.npy').astype(np.int64).ravel()
        y = np.load(p / 'spike_positions.npy')[:, 1]
        bs = json.load(open(p / 'spikecube.json'))['settings']['preprocessing']['batch_size']
        dsh = np.load(p / 'drift.npy')[:, 0] if (p / 'drift.npy').exists() else None
    else:
        st = np.load(p); t = np.round(st[:, 0] * fs).astype(np.int64); y = st[:, 1]
        bs = int(parts[1]); dsh = np.load(parts[2])[:, 0] if len(parts) > 2 else None
    pr = pairs(t)
    di = np.array([a for a, _ in pr]); ti = np.array([b for _, b in pr])
    # expected depth of the true spike in the detection's frame
    yexp = ty[ti] + (dsh[np.clip(tt[ti] // bs, 0, len(dsh) - 1)] if dsh is not None else 0)
    far = np.abs(y[di] - yexp) > float(__import__("os").environ.get("DY", 60))
    top = y > ytop - 20
    print(f'{name:10s} n {len(t):6d}  recall {len(pr)/len(tt):.4f}  recall(|dy|<=DY) {(~far).sum()/len(tt):.4f}  '
          f'matched but far {far.sum():4d} (of them in the top 20 um: {(far & top[di]).sum():4d})  detections in top 20 um {top.sum():5d}')
