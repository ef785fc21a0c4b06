"""spikecube's learned universal templates beside Kilosort4 4.1.7's (docs/benchmarks-history.md).

Usage (numpy):

    python3 benches/learned_vs_ks4.py KS4.npz SPIKECUBE_LEARNED_OUT [SPIKECUBE_BUILTIN_OUT GROUND_TRUTH.npy]

KS4.npz is written by `../shared/tools/ks4ref/ks4_learned.py REC PROBE N_CHAN FS KS4.npz --runs 5`
(Kilosort4's clips of the recording and its wTEMP/wPCA from 5 numpy seeds). Prints, as
one JSON line: the clip counts; the k-means objective of unit-norm centroids on
Kilosort4's clips (ours, Kilosort4's runs); each of our centroids' best |cos| with any
Kilosort4 centroid; per wPCA component the smallest |cos| with Kilosort4's runs, with
numpy's exact SVD, and the singular values; the energy Kilosort4's wPCA captures
relative to ours. With a built-in-template output folder and the ground truth: recall
and precision of both (a true trough matched one-to-one, greedily in time, by a
detection 10 samples later within ±15 samples).
"""
import json
import sys

import numpy as np


def recall_precision(out, truth):
    t = np.sort(np.load(out + '/spike_times.npy')) - 10
    gt = np.sort(truth[:, 0])
    used = np.zeros(len(t), bool)
    hit = 0
    for g in gt:
        lo, hi = np.searchsorted(t, g - 15), np.searchsorted(t, g + 15, 'right')
        for i in range(lo, hi):
            if not used[i]:
                used[i] = True
                hit += 1
                break
    return hit / len(gt), used.sum() / max(len(t), 1), len(t)


def main():
    ks = np.load(sys.argv[1])
    out = sys.argv[2]
    C = ks['clips'].astype(np.float64)
    wT = np.load(out + '/wTEMP.npy').astype(np.float64)
    wP = np.load(out + '/wPCA.npy').astype(np.float64)
    meta = json.load(open(out + '/spikecube.json'))['settings']['templates']

    def objective(w):
        return float(((C[:, None, :] - w[None]) ** 2).sum(-1).min(1).sum())

    def energy(w):
        return float(((C @ w.T) ** 2).sum())

    _, sv, vt = np.linalg.svd(C, full_matrices=False)
    r = {
        'clips_ks4': int(len(C)), 'clips_ours': meta.get('n_clips'),
        'objective_ours': objective(wT), 'objective_ks4_runs': [float(v) for v in ks['inertia']],
        'wtemp_best_cos': [float(max(abs(t @ c) for run in ks['wTEMP'] for c in run)) for t in wT],
        'wpca_min_cos_vs_ks4_runs': [float(min(abs(wP[k] @ run[k]) for run in ks['wPCA'])) for k in range(len(wP))],
        'wpca_cos_vs_exact_svd': [float(abs(wP[k] @ vt[k])) for k in range(len(wP))],
        'singular_values_1_8': [float(v) for v in sv[:8]],
        'ks4_energy_over_ours': [energy(run) / energy(wP) for run in ks['wPCA']],
    }
    r['objective_ratio_to_ks4_median'] = r['objective_ours'] / float(np.median(ks['inertia']))
    if len(sys.argv) > 4:
        truth = np.load(sys.argv[4])
        r['learned_recall_precision_n'] = recall_precision(out, truth)
        r['builtin_recall_precision_n'] = recall_precision(sys.argv[3], truth)
    print(json.dumps(r))


if __name__ == '__main__':
    main()
