"""Kilosort4 4.1.7's own intermediate arrays after detection, for spikecube's sort tests.

Usage: make_sort_fixtures.py REC.bin PROBE.json N_CHAN_BIN FS OUTDIR [--nblocks N] [--dtype int16]
                             [--set key=value ...]

Runs `kilosort.run_kilosort.run_kilosort` on the CPU with Kilosort4's defaults (except the
settings given) and records, by wrapping the stage functions (their code is not changed):

  ops.npz             wPCA (6, 61), wTEMP (6, 61), iC (10, n_centres), xcup, ycup (centres, µm),
                      dmin, dminx, Wrot (C, C), xc, yc (sites, µm), iCC, iCC_mask, iU, Nbatches,
                      fs, batch_size, nt, nt0min, Th_learned, settings as JSON
  first_in.npz        the first clustering's inputs: st0 (n0, 6) float64, tF0 (n0, 10, 6) float32
  first_out.npz       clu0 (n0,) int32, Wall0 (K0, C, 6) float32
  post_out.npz        Wall3 (K, 6, C) float32 (postprocess_templates)
  extract_out.npz     st (n, 3) float64 [sample, template, amplitude], tF (n, 10, 6) float32,
                      iCC (10, C), iCC_mask (10, C), iU (K,)
  final_out.npz       clu (n,) int32, Wall (U1, C, 6) float32 (final clustering)
  merge_out.npz       Wall (U, C, 6), clu (n,), is_ref (U,), st (n, 3), tF (n, 10, 6) after the
                      CCG-gated merges
  groups_{first,final}.npz   per clustering group (call order): n spikes, n features,
                      k-means++ initial labels and final labels (concatenated in call order)
  phy/                Kilosort4's Phy folder (save_to_phy), without ops.npy and the log
  meta.json           versions, counts, timings

Needs the kilosort 4.1.7 venv (../../../../shared/tools/ks4ref/setup_venv.sh) and faiss-cpu.
"""
import json, shutil, sys, time
from pathlib import Path

import numpy as np
import torch


def arg(name, default=None):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


# Every array is recorded as a copy: on the CPU, `.cpu().numpy()` and `np.asarray` share memory
# with Kilosort4's own tensors and arrays, and `merging_function` changes Wall (rows zeroed and
# averaged) and st (shifted times) in place after the final clustering has returned them.


def main():
    rec, probe_path, n_chan_bin, fs, outdir = sys.argv[1:6]
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    settings = dict(n_chan_bin=int(n_chan_bin), fs=float(fs), nblocks=int(arg('--nblocks', '0')))
    for kv in [sys.argv[i + 1] for i, a in enumerate(sys.argv) if a == '--set']:
        k, v = kv.split('=', 1)
        settings[k] = json.loads(v)
    dtype = arg('--dtype', 'int16')
    pj = json.loads(Path(probe_path).read_text())
    probe = {k: np.asarray(pj[k]) for k in ('chanMap', 'xc', 'yc', 'kcoords')}
    probe['chanMap'] = probe['chanMap'].astype(np.int32)
    probe['xc'] = probe['xc'].astype(np.float32)
    probe['yc'] = probe['yc'].astype(np.float32)
    probe['kcoords'] = probe['kcoords'].astype(np.float32)
    probe['n_chan'] = len(probe['chanMap'])

    torch.set_num_threads(int(arg('--threads', '2')))
    import importlib
    rk = importlib.import_module("kilosort.run_kilosort")
    from kilosort import clustering_qr as cq, template_matching as tm
    import kilosort

    cap = {}
    groups = {'spikes': [], 'template': []}
    mode = {'m': None}

    f_run = cq.run

    def run(ops, st, tF, mode_='template', **k):
        m = k.pop('mode', mode_)
        mode['m'] = m
        clu, Wall = f_run(ops, st, tF, mode=m, **k)
        if m == 'spikes':
            cap['first_in'] = dict(st0=np.array(st, np.float64, copy=True), tF0=tF.cpu().numpy().astype(np.float32))
            cap['first_out'] = dict(clu0=np.asarray(clu).astype(np.int32), Wall0=Wall.cpu().numpy().copy())
        else:
            cap['final_out'] = dict(clu=np.asarray(clu).astype(np.int32), Wall=Wall.cpu().numpy().copy())
        return clu, Wall
    cq.run = run

    f_cluster = cq.cluster

    def cluster(Xd, *a, **k):
        # returns (iclust, isub, M, iclust_init): the final and the k-means++ labels
        r = f_cluster(Xd, *a, **k)
        groups[mode['m']].append({'init': np.asarray(r[3].cpu() if hasattr(r[3], 'cpu') else r[3]).astype(np.int32),
                                  'final': np.asarray(r[0].cpu() if hasattr(r[0], 'cpu') else r[0]).astype(np.int32),
                                  'n': int(Xd.shape[0]), 'd': int(Xd.shape[1])})
        return r
    cq.cluster = cluster

    f_post = tm.postprocess_templates

    def postprocess_templates(Wall, ops, clu, st, tF, device=None):
        W3 = f_post(Wall, ops, clu, st, tF, device=device)
        cap['post_out'] = dict(Wall3=W3.cpu().numpy().copy())
        return W3
    tm.postprocess_templates = postprocess_templates

    f_extract = tm.extract

    def extract(ops, bfile, U, device=None, progress_bar=None):
        st, tF, ops = f_extract(ops, bfile, U, device=device, progress_bar=progress_bar)
        cap['extract_out'] = dict(st=np.array(st, np.float64, copy=True), tF=tF.cpu().numpy().astype(np.float32),
                                  iCC=ops['iCC'].cpu().numpy(), iCC_mask=ops['iCC_mask'].cpu().numpy(),
                                  iU=ops['iU'].cpu().numpy())
        return st, tF, ops
    tm.extract = extract

    f_merge = tm.merging_function

    def merging_function(ops, Wall, clu, st, tF, r_thresh=0.5, mode='ccg', device=None, **k):
        r = f_merge(ops, Wall, clu, st, tF, r_thresh=r_thresh, mode=mode, device=device, **k)
        if mode == 'ccg':
            Wm, clum, is_ref, stm, tFm = r
            cap['merge_out'] = dict(Wall=Wm.cpu().numpy(), clu=np.asarray(clum).astype(np.int32),
                                    is_ref=np.asarray(is_ref), st=np.asarray(stm, np.float64),
                                    tF=(tFm.cpu().numpy() if hasattr(tFm, 'cpu') else np.asarray(tFm)).astype(np.float32))
        return r
    tm.merging_function = merging_function

    ks_dir = out / '_ks'
    if ks_dir.exists():
        shutil.rmtree(ks_dir)
    t0 = time.time()
    res = rk.run_kilosort(settings=settings, probe=probe, filename=Path(rec), results_dir=ks_dir,
                          data_dtype=dtype, device=torch.device('cpu'))
    total = time.time() - t0
    ops = res[0]

    for k, v in cap.items():
        np.savez_compressed(out / f'{k}.npz', **v)
    o = {}
    for k in ('wPCA', 'wTEMP', 'iC', 'xcup', 'ycup', 'Wrot', 'xc', 'yc', 'iCC', 'iCC_mask', 'iU'):
        v = ops[k]
        o[k] = v.cpu().numpy() if hasattr(v, 'cpu') else np.asarray(v)
    for k in ('dmin', 'dminx', 'Nbatches', 'fs', 'batch_size', 'nt', 'nt0min', 'Th_learned', 'Th_universal'):
        o[k] = np.asarray(ops[k] if k in ops else ops['settings'][k])
    o['settings_json'] = np.asarray(json.dumps({k: (v if isinstance(v, (int, float, str, bool, type(None))) else str(v))
                                                for k, v in ops['settings'].items()}))
    np.savez_compressed(out / 'ops.npz', **o)
    for m, name in (('spikes', 'first'), ('template', 'final')):
        g = [x for x in groups[m] if 'final' in x]
        if g:
            np.savez_compressed(out / f'groups_{name}.npz', n=np.array([x['n'] for x in g]),
                                d=np.array([x['d'] for x in g]),
                                init=np.concatenate([x['init'] for x in g]),
                                final=np.concatenate([x['final'] for x in g]))
    phy = out / 'phy'
    if phy.exists():
        shutil.rmtree(phy)
    phy.mkdir()
    for p in ks_dir.iterdir():
        if p.is_file() and p.name not in ('ops.npy', 'kilosort4.log') and p.suffix != '.png':
            shutil.copy(p, phy / p.name)
    # params.py names an absolute path: keep only the file name.
    pp = phy / 'params.py'
    if pp.exists():
        lines = [(f"dat_path = ['{Path(rec).name}']" if ln.startswith('dat_path') else ln)
                 for ln in pp.read_text().splitlines()]
        pp.write_text('\n'.join(lines) + '\n')
    shutil.rmtree(ks_dir)
    meta = dict(kilosort=kilosort.__version__, torch=torch.__version__, numpy=np.__version__,
                recording=Path(rec).name, settings=settings, total_s=total,
                n0=int(cap['first_in']['st0'].shape[0]) if 'first_in' in cap else None,
                K0=int(cap['first_out']['Wall0'].shape[0]) if 'first_out' in cap else None,
                K=int(cap['post_out']['Wall3'].shape[0]) if 'post_out' in cap else None,
                n=int(cap['extract_out']['st'].shape[0]) if 'extract_out' in cap else None,
                U1=int(cap['final_out']['Wall'].shape[0]) if 'final_out' in cap else None,
                U=int(cap['merge_out']['Wall'].shape[0]) if 'merge_out' in cap else None)
    (out / 'meta.json').write_text(json.dumps(meta, indent=1))
    print(json.dumps(meta))


if __name__ == '__main__':
    main()
