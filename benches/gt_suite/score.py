"""Ground-truth scores of sortings of one recording of the suite (SpikeInterface).

Usage: score.py REC_DIR OUT.json [--pack DIR] NAME=SPIKES [NAME=SPIKES ...]

REC_DIR holds gt.npz (st, unit) and meta.json (fs) as make_recordings.py
writes them. SPIKES is an npz with st (samples), clu and optionally good (bool
per cluster id), as run_ks4.py writes, or a Phy folder (spike_times.npy,
spike_clusters.npy, cluster_KSLabel.tsv), as Kilosort4 and `spikecube sort`
write. Each sorting is compared with
`compare_sorter_to_ground_truth(exhaustive_gt=True, delta_time=0.4)` (ms),
all its units and then its 'good' units alone. Per comparison: units,
spikes, well-detected units (accuracy >= 0.8), false-positive, redundant,
overmerged and bad units, median and mean accuracy / recall / precision, and
the median lag (sorted minus true sample) of the matched spikes of the
Hungarian-matched pairs, a check of the spike-time convention against the
0.4-ms window. OUT.json gets {recording: {..., NAME: {...}}} merged into
what it already holds, and a one-line summary per sorting is printed.
With --pack DIR, the spike trains are also written compactly for the trip
back (sorted by time: t0 int64 (1,), dts uint32 (n - 1,) differences, and
clu / unit int32; `benches/sort_ground_truth.py` reads this form):
DIR/REC/gt.npz (unit) and DIR/REC/NAME.npz (clu, and good as the cluster ids
labelled good).
"""
import json
import sys
import time
from pathlib import Path

import numpy as np

DELTA_MS = 0.4


def load_spikes(path):
    p = Path(path)
    if p.is_dir():
        st = np.load(p / 'spike_times.npy').astype(np.int64).ravel()
        clu = np.load(p / 'spike_clusters.npy').astype(np.int64).ravel()
        good = None
        lab = p / 'cluster_KSLabel.tsv'
        if lab.exists():
            good = set()
            for line in lab.read_text().splitlines()[1:]:
                cid, label = line.split('\t')[:2]
                if label.strip() == 'good':
                    good.add(int(cid))
        return st, clu, good
    d = np.load(p)
    st = d['st'].astype(np.int64).ravel()
    clu = d['clu'].astype(np.int64).ravel()
    good = set(np.nonzero(d['good'])[0].tolist()) if 'good' in d else None
    return st, clu, good


def matched_lag(gt_t, gt_u, t, c, pairs, fs):
    """Median of (sorted - true) sample over the Hungarian pairs' spikes whose
    nearest sorted spike is within 1 ms."""
    w = int(round(fs / 1000.0))
    lags = []
    for g, s in pairs:
        a = np.sort(gt_t[gt_u == g]); b = np.sort(t[c == s])
        if a.size == 0 or b.size == 0:
            continue
        i = np.clip(np.searchsorted(b, a), 1, b.size - 1) if b.size > 1 else np.zeros(a.size, int)
        near = b[i]
        if b.size > 1:
            left = b[i - 1]
            near = np.where(np.abs(left - a) < np.abs(near - a), left, near)
        d = near - a
        lags.append(d[np.abs(d) <= w])
    lags = np.concatenate(lags) if lags else np.zeros(0)
    return (float(np.median(lags)) if lags.size else None), int(lags.size)


def pack(path, t, labels, key, **extra):
    """Writes spike trains sorted by time as t0, dts (uint32), key (int32)."""
    o = np.argsort(t, kind='stable')
    t = t[o]
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, t0=t[:1], dts=np.diff(t).astype(np.uint32),
                        **{key: labels[o].astype(np.int32)}, **extra)


def score(gt, gt_t, gt_u, t, c, fs):
    import spikeinterface.core as sc
    import spikeinterface.comparison as scmp
    srt = sc.NumpySorting.from_samples_and_labels([t], [c], fs)
    cmp = scmp.compare_sorter_to_ground_truth(gt, srt, exhaustive_gt=True, delta_time=DELTA_MS)
    perf = cmp.get_performance(method='by_unit')
    acc = perf['accuracy'].astype(float)
    rec = perf['recall'].astype(float)
    prec = perf['precision'].astype(float)
    m12 = cmp.hungarian_match_12
    pairs = [(g, s) for g, s in zip(m12.index.values, m12.values) if s != -1]
    lag, n_lag = matched_lag(gt_t, gt_u, t, c, pairs, fs)
    return {'n_units': int(len(srt.unit_ids)), 'n_spikes': int(t.size),
            'well_detected_0.8': int(cmp.count_well_detected_units(0.8)),
            'gt_units_accuracy_ge_0.8': int((acc >= 0.8).sum()),
            'false_positive_units': int(cmp.count_false_positive_units()),
            'redundant_units': int(cmp.count_redundant_units()),
            'overmerged_units': int(cmp.count_overmerged_units()),
            'bad_units': int(cmp.count_bad_units()),
            'median_accuracy': float(acc.median()), 'mean_accuracy': float(acc.mean()),
            'median_recall': float(rec.median()), 'mean_recall': float(rec.mean()),
            'median_precision': float(prec.median()), 'mean_precision': float(prec.mean()),
            'median_lag_samples': lag, 'n_lag_spikes': n_lag}


def main():
    args = sys.argv[1:]
    pack_dir = None
    if '--pack' in args:
        i = args.index('--pack')
        pack_dir = Path(args[i + 1])
        del args[i:i + 2]
    if len(args) < 3:
        sys.exit(__doc__)
    rec_dir, out = Path(args[0]), Path(args[1])
    import spikeinterface
    import spikeinterface.core as sc
    meta = json.loads((rec_dir / 'meta.json').read_text())
    fs = float(meta['fs'])
    g = np.load(rec_dir / 'gt.npz')
    gt_t = g['st'].astype(np.int64); gt_u = g['unit'].astype(np.int64)
    gt = sc.NumpySorting.from_samples_and_labels([gt_t], [gt_u], fs)
    res = {'gt_units': int(np.unique(gt_u).size), 'gt_spikes': int(gt_t.size),
           'seconds': meta['seconds'], 'generator': meta['generator'],
           'spikeinterface': spikeinterface.__version__, 'delta_time_ms': DELTA_MS}
    if pack_dir is not None:
        pack(pack_dir / rec_dir.name / 'gt.npz', gt_t, gt_u, 'unit')
    for arg in args[2:]:
        name, path = arg.split('=', 1)
        if not Path(path).exists():
            res[name] = {'error': f'{path} is missing'}
            print(f'{rec_dir.name} {name}: {path} is missing', flush=True)
            continue
        t0 = time.time()
        st, clu, good = load_spikes(path)
        r = {'all': score(gt, gt_t, gt_u, st, clu, fs)}
        if good is not None:
            keep = np.isin(clu, np.fromiter(good, np.int64, len(good)))
            r['good'] = score(gt, gt_t, gt_u, st[keep], clu[keep], fs)
        r['score_s'] = time.time() - t0
        if pack_dir is not None:
            extra = {} if good is None else {'good': np.array(sorted(good), np.int32)}
            pack(pack_dir / rec_dir.name / f'{name}.npz', st, clu, 'clu', **extra)
        res[name] = r
        for k in ('all', 'good'):
            if k in r:
                s = r[k]
                print(f"{rec_dir.name} {name} ({k}): {s['n_units']} units, {s['n_spikes']} spikes; well detected "
                      f"{s['well_detected_0.8']}/{res['gt_units']}; median accuracy {s['median_accuracy']:.3f} "
                      f"(recall {s['median_recall']:.3f}, precision {s['median_precision']:.3f}); false-positive "
                      f"units {s['false_positive_units']}, redundant {s['redundant_units']}, overmerged "
                      f"{s['overmerged_units']}, bad {s['bad_units']}; median lag {s['median_lag_samples']} samples",
                      flush=True)
    allres = json.loads(out.read_text()) if out.exists() else {}
    allres[rec_dir.name] = res
    out.write_text(json.dumps(allres, indent=1))


if __name__ == '__main__':
    main()
