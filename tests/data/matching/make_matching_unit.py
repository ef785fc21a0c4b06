"""Kilosort4 4.1.7's template post-processing and matching on small synthetic inputs,
for spikecube's `tests/matching.rs`.

Usage (Kilosort4 4.1.7 venv, CPU torch):
    python make_matching_unit.py OUTDIR

Inputs are made here from a fixed numpy seed (20261201):
  * wPCA, wTEMP: Kilosort4's universal ones from tests/data/fixtures/universal_templates/;
  * a 16-site probe (2 columns 32 µm apart, 20 µm rows);
  * Wall0 (K0 = 12, C, 6): templates on 3-6 neighbouring sites, some shifted in time
    (so alignment rolls them), some near copies of others (so the pre-merge joins them),
    one copy with a 40 % larger norm (so it is not merged); clu0 gives their counts;
  * X: windows (C, batch_size + 2 nt) of unit Gaussian noise plus spikes of the
    post-processed templates, some overlapping.

Kilosort4's own functions are called unchanged: `template_matching.postprocess_templates`
(Wall3) and `template_matching.extract` with a stand-in for the binary file that serves X
(st, tF, iCC, iCC_mask, iU).  Written: unit.npz with every input and output.
"""
import sys
from pathlib import Path

import numpy as np
import torch

from kilosort import template_matching as tm

HERE = Path(__file__).resolve().parent
FIX = HERE.parent / 'fixtures' / 'universal_templates'


class Windows:
    """Serves preprocessed windows as `BinaryFiltered.padded_batch_to_torch` does."""

    def __init__(self, X):
        self.X = X
        self.n_batches = len(X)
        self.batch_downsampling = 1

    def padded_batch_to_torch(self, ibatch, ops=None):
        return torch.from_numpy(self.X[ibatch]).clone()


def main():
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    rng = np.random.default_rng(20261201)
    wPCA = np.load(FIX / 'wPCA.npy').astype(np.float32)
    wTEMP = np.load(FIX / 'wTEMP.npy').astype(np.float32)
    nt = wPCA.shape[1]
    C = 16
    xc = np.tile(np.array([0.0, 32.0], np.float32), C // 2)
    yc = np.repeat(np.arange(C // 2, dtype=np.float32) * 20.0, 2)

    def template(centre, shift, gain):
        w = np.roll(wTEMP[rng.integers(0, 2)], shift)
        U = np.zeros((C, 6), np.float32)
        d = np.sqrt((xc - xc[centre]) ** 2 + (yc - yc[centre]) ** 2)
        for c in np.argsort(d, kind='stable')[:rng.integers(3, 7)]:
            U[c] = gain * np.exp(-d[c] / 40.0) * (wPCA @ w)
        return U

    Ws = []
    for k in range(8):
        Ws.append(template(rng.integers(0, C), int(rng.integers(-4, 5)), float(rng.uniform(8, 14))))
    Ws.append(Ws[1] * 1.05 + 0.05 * rng.standard_normal((C, 6)).astype(np.float32) * (Ws[1] != 0))
    Ws.append(Ws[3] * 0.97)
    Ws.append(Ws[1] * 1.4)
    Ws.append(np.roll(Ws[5] @ wPCA, 3, axis=1) @ wPCA.T)
    Wall0 = np.stack(Ws).astype(np.float32)
    K0 = len(Wall0)
    counts = rng.integers(50, 400, K0)
    clu0 = np.repeat(np.arange(K0), counts).astype(np.int32)
    rng.shuffle(clu0)

    settings = dict(nearest_chans=10, position_limit=100, n_pcs=6, acg_threshold=0.2,
                    ccg_threshold=0.25, max_peels=100)
    ops = dict(settings=settings, nt=nt, nt0min=20, Nchan=C, batch_size=3000, Th_learned=8,
               max_peels=100, xc=xc, yc=yc, fs=30000.0,
               wPCA=torch.from_numpy(wPCA), wTEMP=torch.from_numpy(wTEMP))
    st0 = np.zeros((len(clu0), 6))
    tF0 = torch.zeros((len(clu0), 10, 6))
    Wall3 = tm.postprocess_templates(torch.from_numpy(Wall0), ops, clu0, st0, tF0,
                                     device=torch.device('cpu')).cpu().numpy()
    K = len(Wall3)

    NT = ops['batch_size'] + 2 * nt
    X = []
    for b in range(3):
        x = rng.standard_normal((C, NT)).astype(np.float32)
        t = 40
        while t < NT - 40:
            k = rng.integers(0, K)
            wave = Wall3[k].T @ wPCA
            amp = float(rng.uniform(0.6, 2.5))
            lo, hi = t - nt // 2, t + nt // 2 + 1
            a, z = max(lo, 0), min(hi, NT)
            x[:, a:z] += amp * wave[:, a - lo:nt - (hi - z)]
            t += int(rng.integers(5, 140))
        X.append(x)
    X = np.stack(X)

    st, tF, ops2 = tm.extract(ops, Windows(X), torch.from_numpy(Wall3), device=torch.device('cpu'))
    np.savez_compressed(out / 'unit.npz', wPCA=wPCA, wTEMP=wTEMP, xc=xc, yc=yc, Wall0=Wall0,
                        clu0=clu0, Wall3=Wall3, X=X, st=st, tF=tF.numpy(),
                        iCC=ops2['iCC'].cpu().numpy(), iCC_mask=ops2['iCC_mask'].cpu().numpy(),
                        iU=ops2['iU'].cpu().numpy(), batch_size=np.int64(ops['batch_size']))
    print(f'K0 {K0} -> K {K}; {len(st)} spikes in {len(X)} windows of {NT}')


if __name__ == '__main__':
    main()
