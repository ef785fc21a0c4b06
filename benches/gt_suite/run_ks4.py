"""Kilosort4 (PyPI 4.1.7) whole sort of one flat int16 recording, default settings.

Usage: run_ks4.py REC.bin PROBE.json N_CHAN_BIN FS RESULTS_DIR OUT.npz [--device cuda|cpu]

Calls kilosort.run_kilosort with settings {'n_chan_bin', 'fs'} only (every
other setting Kilosort4's default, as ../shared/tools/ks4ref/sort_h200.py ran
it), the probe loaded by kilosort.io.load_probe, and writes OUT.npz:
  st   int64, spike_times.npy (samples), in Kilosort4's order;
  clu  int32, spike_clusters.npy;
  good bool per cluster id (0 .. max), cluster_KSLabel.tsv == 'good';
and OUT.json: wall seconds (import, run_kilosort, total), unit and spike
counts, Kilosort4's own stage runtimes (ops['runtime*']) and versions.

The machine has no network: Kilosort4 would download wTEMP.npz into its
downloads folder the first time it needs the built-in templates. The PyPI
wheel ships the same file inside the package, so KILOSORT_LOCAL_DOWNLOADS_PATH
(read when kilosort is imported) points at RESULTS_DIR/../ks4_downloads,
seeded with the packaged copy before the import.
"""
import argparse
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

T0 = time.time()


def seed_downloads(folder):
    folder.mkdir(parents=True, exist_ok=True)
    os.environ['KILOSORT_LOCAL_DOWNLOADS_PATH'] = str(folder)
    spec = importlib.util.find_spec('kilosort')
    if spec is None or spec.origin is None:
        sys.exit('kilosort is not installed')
    packaged = Path(spec.origin).parent / 'wTEMP.npz'
    if not (folder / 'wTEMP.npz').exists():
        shutil.copyfile(packaged, folder / 'wTEMP.npz')


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('rec', type=Path)
    ap.add_argument('probe', type=Path)
    ap.add_argument('n_chan_bin', type=int)
    ap.add_argument('fs', type=float)
    ap.add_argument('results_dir', type=Path)
    ap.add_argument('out', type=Path)
    ap.add_argument('--device', default='cuda')
    a = ap.parse_args()

    seed_downloads(a.results_dir.parent / 'ks4_downloads')
    import torch
    import kilosort
    from kilosort import run_kilosort
    from kilosort.io import load_probe
    dev = torch.device(a.device)
    t_import = time.time() - T0

    probe = load_probe(str(a.probe))
    settings = {'n_chan_bin': a.n_chan_bin, 'fs': a.fs}
    t0 = time.time()
    res = run_kilosort(settings=settings, probe=probe, filename=a.rec, results_dir=a.results_dir, device=dev)
    if a.device.startswith('cuda'):
        torch.cuda.synchronize()
    t_run = time.time() - t0
    ops = res[0]

    d = a.results_dir
    st = np.load(d / 'spike_times.npy').astype(np.int64).ravel()
    clu = np.load(d / 'spike_clusters.npy').astype(np.int32).ravel()
    lines = (d / 'cluster_KSLabel.tsv').read_text().splitlines()[1:]
    n_clu = int(clu.max()) + 1 if clu.size else 0
    good = np.zeros(n_clu, bool)
    for line in lines:
        cid, lab = line.split('\t')[:2]
        if int(cid) < n_clu:
            good[int(cid)] = lab.strip() == 'good'
    a.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(a.out, st=st, clu=clu, good=good)
    info = {'sorter': 'kilosort', 'device': a.device,
            'gpu': torch.cuda.get_device_name() if a.device.startswith('cuda') else 'cpu',
            'wall_s': {'import': t_import, 'run_kilosort': t_run, 'total': time.time() - T0},
            'n_spikes': int(st.size), 'n_units': int(np.unique(clu).size), 'n_good': int(good.sum()),
            'ks4_runtimes_s': {k: float(v) for k, v in ops.items()
                               if k.startswith('runtime') and np.isscalar(v)},
            'settings': settings,
            'versions': {'kilosort': kilosort.__version__, 'torch': torch.__version__,
                         'numpy': np.__version__, 'torch_threads': torch.get_num_threads()}}
    try:
        import faiss
        info['versions']['faiss'] = faiss.__version__
    except Exception:  # noqa: BLE001
        pass
    a.out.with_suffix('.json').write_text(json.dumps(info, indent=1))
    print(f"kilosort {a.rec.parent.name}: {info['n_units']} units ({info['n_good']} good), {st.size} spikes; "
          f"run_kilosort {t_run:.1f} s, total {info['wall_s']['total']:.1f} s", flush=True)


if __name__ == '__main__':
    main()
