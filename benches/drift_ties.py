"""Every difference between spikecube's and Kilosort4's drift-corrected second
pass, explained (docs/benchmarks-history.md, "Drift: every difference explained").

Inputs (made as the "Drift: every difference explained" section of
docs/benchmarks-history.md lists):
  KS   Kilosort4's export (benches/drift_ties_ks4.py): its windows ks_X_<b>.npy,
       its template_match results ks_xy/ks_imax/ks_amp_<b>.npy, st.npy,
       dshift.npy, iC/iC2/weigh.npy;
  SCX  spikecube's second-pass windows sc_X_<b>.npy (benches/drift_windows.rs);
  DET  spikecube `detect` output of the same run (spike_times.npy, drift.npy);
  OK   `detect-window --neighbourhoods KS` on each ks_X_<b>.npy: OK/<b>/;
  OO   `detect-window --neighbourhoods KS` on each sc_X_<b>.npy: OO/<b>/;
  OG   (optional) `detect-window` with spikecube's own neighbourhoods on each
       sc_X_<b>.npy: OG/<b>/.

Checks, in order:
 1. spikecube's detector on Kilosort4's windows gives Kilosort4's detections
    exactly (centre, sample, template; amplitude within 1e-5 relative).
 2. spikecube's detector on its own windows gives the `detect` run's spike
    times (the windows are the pipeline's).
 3. Every (centre, sample) detection that one side has and the other lacks is
    recomputed in float64 on both windows from the detection rule
    (detection-spec.md §7): As = max over the 30 filters of |A|, detected iff
    As > Th_universal and As is the largest over its iC2 centres and ±nt0min
    samples (edge samples of Amax zeroed). The decisive margin is
    min(As − Th, As − best competitor); it is ≥ 0 on the side that detects
    and < 0 on the other. Each difference gets its kind (threshold; the
    competitor at the same centre, another sample; another centre), both
    margins in float32 units of As (ulp) and relative, and the largest data
    difference |X_sc − X_ks| over the sites and samples it reads.

Usage (ks4ref venv python, numpy only):
    python drift_ties.py --ks KS [--pass 1|2] --scx SCX --ok OK --oo OO [--det DET] [--og OG]
                         [--json OUT.json]
(--pass 1: the first, uncorrected pass: Kilosort4's ks1_* files and spikecube's
W-whitened windows.)
"""
import argparse
import json
from pathlib import Path

import numpy as np

NT, NT0MIN, TH = 61, 20, 9.0


def wtemp():
    import kilosort
    return np.load(Path(kilosort.__file__).parent / 'wTEMP.npz')['wTEMP'].astype(np.float64)


def load_det(d):
    d = Path(d)
    xy = np.load(d / 'xy.npy').astype(np.int64).reshape(-1, 2)
    return xy, np.load(d / 'imax.npy').astype(np.int64).ravel(), np.load(d / 'amp.npy').ravel()


def as_patch(X, W, iC, weigh, centres, t_lo, t_hi):
    """As[j, t] (float64) for the given centres and samples t_lo..t_hi (inclusive)."""
    C, N = X.shape
    half = W.shape[1] // 2
    lo, hi = t_lo - half, t_hi + half + 1
    Xp = np.zeros((C, hi - lo))
    a, b = max(lo, 0), min(hi, N)
    Xp[:, a - lo:b - lo] = X[:, a:b]
    n = t_hi - t_lo + 1
    # B[c, k, t] = sum_i W[k, i] X[c, t + i - half]
    idx = np.arange(n)[:, None] + np.arange(W.shape[1])[None, :]
    sites = np.unique(iC[:, centres])
    B = np.zeros((C, W.shape[0], n))
    B[sites] = np.einsum('cti,ki->ckt', Xp[sites][:, idx], W)
    out = np.zeros((len(centres), n))
    for q, j in enumerate(centres):
        A = np.einsum('sc,ckt->skt', weigh[:, :, j], B[iC[:, j]])
        out[q] = np.abs(A).reshape(-1, n).max(0)
    return out


def margins(X, W, iC, iC2, weigh, j, t, npad):
    """Decisive quantities of detection (j, t) on window X (float64)."""
    nbr = iC2[:, j]
    centres = np.unique(np.concatenate([[j], nbr]))
    lo, hi = t - NT0MIN, t + NT0MIN
    P = as_patch(X.astype(np.float64), W, iC, weigh, centres, lo, hi)
    ts = np.arange(lo, hi + 1)
    Pz = P.copy()
    Pz[:, (ts < NT) | (ts >= npad - NT)] = 0.0  # Amax's edge zeroing
    Pz[:, (ts < 0) | (ts >= npad)] = -np.inf
    q0 = int(np.searchsorted(centres, j))
    a = P[q0, NT0MIN]
    Pz[q0, NT0MIN] = -np.inf
    nb_mask = np.isin(centres, nbr)
    comp = np.where(nb_mask[:, None], Pz, -np.inf)
    qc, tc = np.unravel_index(np.argmax(comp), comp.shape)
    return dict(As=a, comp=comp[qc, tc], comp_centre=int(centres[qc]), comp_dt=int(tc - NT0MIN),
                m_th=a - TH, m_loc=a - comp[qc, tc])


def ulp(v):
    return np.spacing(np.float32(abs(v))).astype(np.float64)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--ks', required=True, type=Path)
    ap.add_argument('--pass', dest='pass_', type=int, default=2, choices=(1, 2),
                    help='1: the first (uncorrected) pass, files ks1_*; 2: the second, ks_*')
    ap.add_argument('--scx', required=True, type=Path)
    ap.add_argument('--ok', required=True, type=Path)
    ap.add_argument('--oo', required=True, type=Path)
    ap.add_argument('--det', type=Path, help='the detect run whose windows SCX are')
    ap.add_argument('--og', type=Path)
    ap.add_argument('--json', type=Path)
    a = ap.parse_args()
    ks, scx, ok, oo, det, og, out_json = a.ks, a.scx, a.ok, a.oo, a.det, a.og, a.json
    pre = 'ks' if a.pass_ == 2 else 'ks1'
    meta = json.load(open(ks / 'meta.json'))
    nb, bsz = meta['n_batches'], meta['batch_size']
    iC, iC2 = np.load(ks / 'iC.npy'), np.load(ks / 'iC2.npy')
    weigh = np.load(ks / 'weigh.npy').astype(np.float64)
    W = wtemp()
    res = {'windows': nb, 'batch_size': bsz}

    # 1. our detector on Kilosort4's windows
    same = tot = amp_rel = 0
    for b in range(nb):
        kxy, kim, kamp = (np.load(ks / f'{pre}_{n}_{b}.npy') for n in ('xy', 'imax', 'amp'))
        oxy, oim, oamp = load_det(ok / str(b))
        ko = np.lexsort((kxy[:, 1], kxy[:, 0]))
        oo_ = np.lexsort((oxy[:, 1], oxy[:, 0]))
        eq = (len(kxy) == len(oxy) and np.array_equal(kxy[ko], oxy[oo_])
              and np.array_equal(kim[ko], oim[oo_]))
        tot += len(kxy)
        if eq:
            same += len(kxy)
            amp_rel = max(amp_rel, float(np.max(np.abs(kamp[ko] - oamp[oo_]) / kamp[ko], initial=0)))
        else:
            ks_set = {tuple(v) for v in kxy}
            same += sum(tuple(v) in ks_set for v in oxy)
            print(f'window {b}: ours on Kilosort4\'s window differs: {len(kxy)} vs {len(oxy)}')
    res['ours_on_ks_windows'] = {'ks_detections': tot, 'identical': same, 'max_amp_rel_diff': amp_rel}
    print(f'1. ours on Kilosort4\'s windows: {same} of {tot} detections identical '
          f'(centre, sample, template); amplitudes within {amp_rel:.2e} relative')

    # 2. our detector on our windows (= the detect run's, when --det is given)
    mine, per_b = [], {}
    for b in range(nb):
        xy, im, amp = load_det(oo / str(b))
        per_b[b] = xy
        own = (xy[:, 1] >= NT) & (xy[:, 1] < NT + bsz)
        mine.append(b * bsz + xy[own, 1] - NT)
    mine = np.sort(np.concatenate(mine))
    if det is not None:
        sc_t = np.sort(np.load(det / 'spike_times.npy').astype(np.int64).ravel())
        res['ours_on_our_windows_equal_detect'] = bool(np.array_equal(mine, sc_t))
        print(f'2. ours on our windows = the detect run\'s spike times: '
              f'{np.array_equal(mine, sc_t)} ({len(mine)} and {len(sc_t)})')
    # Spike times (samples) of the two passes, own samples of each window.
    ks_t = []
    for b in range(nb):
        kxy = np.load(ks / f'{pre}_xy_{b}.npy')
        own = (kxy[:, 1] >= NT) & (kxy[:, 1] < NT + bsz)
        ks_t.append(b * bsz + kxy[own, 1] - NT)
    ks_t = np.sort(np.concatenate(ks_t))
    # Multiset intersection: two detections at one sample count twice.
    uk, ck = np.unique(ks_t, return_counts=True)
    um, cm = np.unique(mine, return_counts=True)
    _, ik, im_ = np.intersect1d(uk, um, return_indices=True)
    common = int(np.minimum(ck[ik], cm[im_]).sum())
    res['spike_times'] = {'ks4': int(len(ks_t)), 'spikecube': int(len(mine)), 'same_sample': int(common)}
    print(f'   spike times: Kilosort4 {len(ks_t)}, spikecube {len(mine)}, same sample {common} '
          f'({100 * common / len(ks_t):.2f} % of Kilosort4\'s)')

    if og is not None:
        g_same = g_tot = 0
        for b in range(nb):
            gxy, _, _ = load_det(og / str(b))
            s1 = {tuple(v) for v in per_b[b]}
            g_tot += len(s1)
            g_same += sum(tuple(v) in s1 for v in gxy)
            if len(gxy) != len(s1) or g_same != g_tot:
                pass
        res['own_neighbourhoods_vs_ks'] = {'with_ks_neighbourhoods': g_tot, 'same_with_own': g_same}
        print(f'   own neighbourhoods vs Kilosort4\'s on our windows: {g_same} of {g_tot} the same')

    # 3. every (centre, sample) difference
    rows = []
    maxdiff_all = 0.0
    for b in range(nb):
        Xk = np.load(ks / f'{pre}_X_{b}.npy')
        Xo = np.load(scx / f'sc_X_{b}.npy')
        npad = Xk.shape[1]
        d = np.abs(Xk.astype(np.float64) - Xo)
        # In float32 units (ulp) of the window's largest |value|.
        maxdiff_all = max(maxdiff_all, float(d.max() / ulp(np.abs(Xk).max())))
        kxy = np.load(ks / f'{pre}_xy_{b}.npy')
        oxy = per_b[b]
        ks_set, oo_set = {tuple(v) for v in kxy}, {tuple(v) for v in oxy}
        for side, only in (('spikecube', oo_set - ks_set), ('kilosort4', ks_set - oo_set)):
            for (j, t) in sorted(only):
                mo = margins(Xo, W, iC, iC2, weigh, j, t, npad)
                mk = margins(Xk, W, iC, iC2, weigh, j, t, npad)
                mp, mq = (mo, mk) if side == 'spikecube' else (mk, mo)
                dec_p = min(mp['m_th'], mp['m_loc'])
                dec_q = min(mq['m_th'], mq['m_loc'])
                if mq['m_th'] <= mq['m_loc']:
                    kind = 'threshold'
                elif mq['comp_centre'] == j:
                    kind = 'same centre, other sample'
                else:
                    kind = 'other centre'
                sites = np.unique(iC[:, np.concatenate([[j], iC2[:, j]])])
                lo, hi = max(t - NT0MIN - 30, 0), min(t + NT0MIN + 31, npad)
                dd = d[sites, lo:hi]
                scale = np.abs(Xk[sites, lo:hi]).max()
                rows.append(dict(
                    window=b, centre=int(j), sample=int(t), only_in=side, kind=kind,
                    own=bool(NT <= t < NT + bsz),
                    As_detecting=float(mp['As']), competitor_centre=mq['comp_centre'],
                    competitor_dt=mq['comp_dt'],
                    margin_detecting=float(dec_p), margin_other=float(dec_q),
                    margin_detecting_ulp=float(dec_p / ulp(mp['As'])),
                    margin_other_ulp=float(dec_q / ulp(mp['As'])),
                    margin_rel=float(max(abs(dec_p), abs(dec_q)) / mp['As']),
                    data_max_abs_diff=float(dd.max()), data_max_abs=float(scale),
                    data_diff_ulp=float(dd.max() / ulp(scale))))
    res['data_max_diff_ulp_of_value'] = maxdiff_all
    res['differences'] = rows
    kinds = {}
    for r in rows:
        k = kinds.setdefault(r['kind'], dict(n=0, own=0, max_ulp=0.0, max_rel=0.0,
                                              explained=0))
        k['n'] += 1
        k['own'] += r['own']
        worst = max(abs(r['margin_detecting_ulp']), abs(r['margin_other_ulp']))
        k['max_ulp'] = max(k['max_ulp'], worst)
        k['max_rel'] = max(k['max_rel'], r['margin_rel'])
        # A float tie: the decision flips (detecting side ≥ 0, other < 0 in
        # float64), or the margin is within a few float32 units of As either way.
        k['explained'] += (r['margin_detecting'] >= 0 > r['margin_other']) or worst <= 8
    res['kinds'] = kinds
    print(f'3. {len(rows)} (centre, sample) differences in {nb} windows '
          f'(largest data difference anywhere: {maxdiff_all:.2f} float32 units of the largest value of its window)')
    for k, v in kinds.items():
        print(f'   {k:28s} {v["n"]:4d} ({v["own"]} in own samples); flips in float64: '
              f'{v["explained"]}; largest |margin| {v["max_ulp"]:.1f} ulp of As, '
              f'{v["max_rel"]:.2e} relative')
    for r in rows:
        print(f'   w{r["window"]:<3d} j{r["centre"]:<4d} t{r["sample"]:<6d} only {r["only_in"]:9s} '
              f'{r["kind"]:26s} As {r["As_detecting"]:8.4f} margins {r["margin_detecting_ulp"]:+8.2f} / '
              f'{r["margin_other_ulp"]:+8.2f} ulp; competitor j{r["competitor_centre"]} '
              f'dt {r["competitor_dt"]:+d}; data diff {r["data_diff_ulp"]:.1f} ulp')
    if out_json:
        json.dump(res, open(out_json, 'w'), indent=1)


if __name__ == '__main__':
    main()
