"""Agreement of two sortings of the same recording: for each unit of the first
(Kilosort4), the best SpikeInterface agreement score with a unit of the second
(compare_two_sorters, delta 0.4 ms).

Usage: sort_agreement.py KS4_SPIKES.npz SPIKECUBE_SPIKES.npz (t0, dts, clu as
sort_h200.py's spikes_A.npz, or st, clu)."""
import sys, numpy as np, spikeinterface.core as sc, spikeinterface.comparison as scmp
def load(p):
    d = np.load(p)
    t = np.concatenate([d['t0'].astype(np.int64), d['t0'][0] + np.cumsum(d['dts'].astype(np.int64))]) if 't0' in d else d['st'].astype(np.int64)
    return sc.NumpySorting.from_samples_and_labels([t], [d['clu'].astype(np.int64)], 30000.0)
a, b = load(sys.argv[1]), load(sys.argv[2])
c = scmp.compare_two_sorters(a, b, sorting1_name='ks4', sorting2_name='spikecube', delta_time=0.4)
sc_ = c.agreement_scores
ag = sc_.max(axis=1).reindex(a.unit_ids).fillna(0).values
print(f"Kilosort4 units {len(a.unit_ids)}: matched at agreement >= 0.9: {(ag >= 0.9).sum()} ({(ag >= 0.9).mean()*100:.1f} %), >= 0.5: {(ag >= 0.5).sum()}; median {np.median(ag):.3f}")
