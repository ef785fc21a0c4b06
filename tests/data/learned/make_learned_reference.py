"""Writes the learned-template references in tests/data/learned/ with Kilosort4 4.1.7.

Run with the Kilosort4 venv from the repository root:
    python tests/data/learned/make_learned_reference.py [ks4_learned.npz]

1. clips/: for each whitened window already in tests/data/fixtures (the detection
   cases' X.npy and the preprocessing fixture's padded batches), Kilosort4's own
   spikedetect.extract_snippets (nt=61, twav_min=20, Th_single_ch=6) on CPU:
   <name>_clips.npy (n x 61 float32, not normalised) and <name>_xy.npy (n x 2 int64,
   site and sample of each peak, from is_peak_iso.nonzero(), row-major order).
2. kmeans/ (only when a ks4_learned.npz from ks4_learned.py is given): the first
   N_SUB of Kilosort4's normalised clips of that recording, then Kilosort4's own
   wPCA/wTEMP steps (TruncatedSVD(n_components=6), KMeans(6, n_init=10), centroids
   divided by their norm) on those clips with numpy seeds 0..4, the same calls
   extract_wPCA_wTEMP makes, and each run's k-means objective of its normalised
   centroids on the clips; and numpy's exact float64 SVD of those clips (its first 6
   right singular vectors and all singular values).
"""
import sys
from pathlib import Path
import numpy as np
import torch
from kilosort import spikedetect
from sklearn.cluster import KMeans
from sklearn.decomposition import TruncatedSVD

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
N_SUB = 1500


def main():
    out = HERE / 'clips'
    out.mkdir(exist_ok=True)
    windows = sorted((ROOT / 'tests/data/fixtures/detection').glob('*/X.npy'))
    windows += sorted((ROOT / 'tests/data/fixtures/preprocessing').glob('batch_*.npy'))
    total = 0
    for f in windows:
        name = f.parent.name if f.name == 'X.npy' else f.stem
        X = torch.from_numpy(np.load(f))
        clips = spikedetect.extract_snippets(X, nt=61, twav_min=20, Th_single_ch=6,
                                             device=torch.device('cpu')).numpy()
        # the peaks themselves, as extract_snippets finds them (same calls)
        Xabs = X.abs()
        Xmax = spikedetect.my_max2d(Xabs, [4, 5])
        ispeak = torch.logical_and(Xmax == Xabs, Xabs > 6).float()
        s = spikedetect.my_sum2d(ispeak, [6, 30])
        iso = (s == 1) * (ispeak == 1)
        iso[:, :61] = 0
        iso[:, -61:] = 0
        xy = iso.nonzero().numpy().astype(np.int64)
        assert len(xy) == len(clips)
        np.save(out / f'{name}_clips.npy', clips.astype(np.float32))
        np.save(out / f'{name}_xy.npy', xy)
        total += len(clips)
        print(f'{f.relative_to(ROOT)}: {len(clips)} clips')
    print(f'{total} clips in all')
    if len(sys.argv) > 1:
        d = np.load(sys.argv[1])
        C = d['clips'][:N_SUB].astype(np.float32)
        wT, wP, inertia = [], [], []
        for seed in range(5):
            np.random.seed(seed)
            svd = TruncatedSVD(n_components=6).fit(C)
            km = KMeans(n_clusters=6, n_init=10).fit(C)
            w = km.cluster_centers_ / np.sqrt((km.cluster_centers_ ** 2).sum(1, keepdims=True))
            dd = ((C[:, None, :].astype(np.float64) - w[None].astype(np.float64)) ** 2).sum(-1)
            wT.append(w.astype(np.float32)); wP.append(svd.components_.astype(np.float32))
            inertia.append(dd.min(1).sum())
        (HERE / 'kmeans').mkdir(exist_ok=True)
        np.save(HERE / 'kmeans/clips.npy', C)
        np.save(HERE / 'kmeans/wTEMP_runs.npy', np.array(wT))
        np.save(HERE / 'kmeans/wPCA_runs.npy', np.array(wP))
        np.save(HERE / 'kmeans/inertia_runs.npy', np.array(inertia))
        # numpy's exact (LAPACK) SVD of the same clips, float64: the reference subspace
        _, sv, vt = np.linalg.svd(C.astype(np.float64), full_matrices=False)
        np.save(HERE / 'kmeans/svd_exact_vt.npy', vt[:6])
        np.save(HERE / 'kmeans/singular_values.npy', sv)
        print(f'{len(C)} clips; inertia per run: {np.round(inertia, 3).tolist()}')


if __name__ == '__main__':
    main()
