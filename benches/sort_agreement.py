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
# One-to-one (Hungarian) matching, as compare_two_sorters makes it: a
# Kilosort4 unit counts when its matched unit's agreement reaches the bar.
m12 = c.hungarian_match_12
hung = np.array([sc_.at[u, m12[u]] if m12[u] != -1 else 0.0 for u in a.unit_ids])
print(f"Hungarian one-to-one: {(hung >= 0.9).sum()} of {len(a.unit_ids)} Kilosort4 units ({(hung >= 0.9).mean()*100:.1f} %) at agreement >= 0.9, {(hung >= 0.95).sum()} at >= 0.95")
