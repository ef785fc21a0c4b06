"""Ground-truth scores of sortings of sort_h200.py's simulation: SpikeInterface's
compare_sorter_to_ground_truth (exhaustive, delta 0.4 ms) per sorting.

Usage: sort_ground_truth.py GT.npz NAME=SPIKES.npz ... (GT: t0, dts, unit as
sort_h200.py writes it; SPIKES: t0, dts, clu as its spikes_A.npz, or st, clu)."""
import sys
import numpy as np
import spikeinterface.core as sc
import spikeinterface.comparison as scmp

FS = 30000.0
def load_times(d, tkey):
    if 't0' in d:
        return np.concatenate([d['t0'].astype(np.int64), d['t0'][0] + np.cumsum(d['dts'].astype(np.int64))])
    return d[tkey].astype(np.int64).ravel()

g = np.load(sys.argv[1])
gt_t = load_times(g, 'st'); gt_u = g['unit'].astype(np.int64)
# Kilosort4's spike_times are the trough + 0 (its st is the trough sample); the simulator puts the trough at t.
gt = sc.NumpySorting.from_samples_and_labels([gt_t], [gt_u], FS)
for arg in sys.argv[2:]:
    name, path = arg.split('=')
    d = np.load(path)
    t = load_times(d, 'st'); c = d['clu'].astype(np.int64).ravel()
    srt = sc.NumpySorting.from_samples_and_labels([t], [c], FS)
    cmp = scmp.compare_sorter_to_ground_truth(gt, srt, exhaustive_gt=True, delta_time=0.4)
    perf = cmp.get_performance()
    acc = perf['accuracy'].values
    well = int((acc >= 0.8).sum())
    fp = cmp.count_false_positive_units() if hasattr(cmp, 'count_false_positive_units') else -1
    red = cmp.count_redundant_units(); bad = cmp.count_bad_units()
    print(f"{name}: {len(np.unique(c))} units, {t.size} spikes; well detected (acc>=0.8) {well}/{len(np.unique(gt_u))}; "
          f"median accuracy {np.median(acc):.3f}, recall {np.median(perf['recall']):.3f}, precision {np.median(perf['precision']):.3f}; "
          f"false-positive units {fp}, redundant {red}, bad {bad}")
