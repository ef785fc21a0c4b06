"""Kilosort4's own detection (`kilosort.spikedetect.template_match`) on a GPU,
timed beside spikecube's GPU detector on the same window (docs/benchmarks-history.md).

Usage (torch with CUDA and the `kilosort==4.1.7` package importable; the tools of
`../shared/tools/ks4ref/` on PYTHONPATH):

    python3 benches/ks4_template_match_gpu.py OUTDIR [--repeat 20] [--seed 1]

1. writes the benchmark window with the fixture generator
   (`make_window.py np2_1shank 60000 1500 SEED`: OUTDIR/X.npy, probe.json), and
   Kilosort4's neighbourhoods for it (OUTDIR/iC.npy, iC2.npy, weigh.npy);
2. times `template_match` on the GPU: one warm-up call, then REPEAT calls, each
   followed by `torch.cuda.synchronize()`; prints the median, the detections and
   the peak GPU memory torch allocated.

Kilosort4's package imports plotting, clustering and JIT libraries that detection
never calls; where one of those is not installed, an empty stand-in module is
used (as for `faiss`), so that `spikedetect` can be imported.
"""
import importlib.abc
import importlib.machinery
import json
import sys
import time
import types
from pathlib import Path


def _identity_decorator(*a, **k):
    if len(a) == 1 and callable(a[0]) and not k:
        return a[0]
    return lambda f: f


class _Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith('__'):
            raise AttributeError(name)
        if name in ('tqdm', 'trange'):
            return lambda it=None, *a, **k: (it if name == 'tqdm' else range(it)) if it is not None else []
        return _identity_decorator


class _Fallback(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on sys.meta_path: only modules that are not installed reach it."""
    roots = {'sklearn', 'numba', 'faiss', 'psutil', 'matplotlib', 'pandas', 'tqdm', 'scipy'}

    def find_spec(self, name, path, target=None):
        if name.split('.')[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _Stub(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


sys.meta_path.append(_Fallback())

import numpy as np  # noqa: E402
import torch  # noqa: E402
import ks4common as kc  # noqa: E402
from make_fixtures import synth_window  # noqa: E402
from kilosort import spikedetect  # noqa: E402


def main():
    out = Path(sys.argv[1])
    repeat = int(sys.argv[sys.argv.index('--repeat') + 1]) if '--repeat' in sys.argv else 20
    seed = int(sys.argv[sys.argv.index('--seed') + 1]) if '--seed' in sys.argv else 1
    out.mkdir(parents=True, exist_ok=True)
    probe0 = kc.make_probe('np2_1shank')
    kc.save_probe_json(probe0, out / 'probe.json')
    probe = kc.load_probe_json(out / 'probe.json')
    _, wTEMP = spikedetect.get_waves({}, device=kc.CPU)
    X, truth = synth_window(np.random.default_rng(seed), probe, 60000 + 2 * kc.NT, 1500, wTEMP.numpy())
    np.save(out / 'X.npy', X)
    np.save(out / 'truth.npy', truth)
    # Neighbourhoods depend on the probe and settings only: take them from a run
    # of spikedetect.run on a short window (CPU), then move them to the GPU.
    short = torch.from_numpy(np.ascontiguousarray(X[:, :2000 + 2 * kc.NT]))
    ops = kc.run_ks4(short, probe, batch_size=2000)['ops']
    np.save(out / 'iC.npy', ops['iC'].numpy())
    np.save(out / 'iC2.npy', ops['iC2'].numpy())
    np.save(out / 'weigh.npy', ops['weigh'].numpy())
    dev = torch.device('cuda')
    for k in ('iC', 'iC2', 'weigh', 'wTEMP', 'wPCA'):
        ops[k] = ops[k].to(dev)
    Xg = torch.from_numpy(X).to(dev)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    res = spikedetect.template_match(Xg, ops, ops['iC'], ops['iC2'], ops['weigh'], device=dev)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        res = spikedetect.template_match(Xg, ops, ops['iC'], ops['iC2'], ops['weigh'], device=dev)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    xy = res[0].cpu().numpy()
    # The same window's upload through torch, for comparison with CubeCL's.
    up = {}
    Xpin = torch.from_numpy(X).pin_memory()
    for label, src in (('pageable', torch.from_numpy(X)), ('pinned', Xpin)):
        ts = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            src.to(dev, non_blocking=False)
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        ts.sort()
        up[label] = 1e3 * ts[2]
    times.sort()
    summary = {
        'gpu': torch.cuda.get_device_name(0),
        'torch': torch.__version__,
        'window': list(X.shape),
        'centres': int(ops['iC'].shape[1]),
        'detections': int(len(xy)),
        'template_match_ms_median': 1e3 * times[len(times) // 2],
        'template_match_ms_min': 1e3 * times[0],
        'repeat': repeat,
        'peak_gpu_memory_mb': (torch.cuda.max_memory_allocated() - base) / 1e6,
        'torch_upload_ms_median': up,
    }
    np.save(out / 'ks4_xy.npy', xy)
    (out / 'ks4_gpu.json').write_text(json.dumps(summary, indent=1))
    print('KS4', json.dumps(summary))


if __name__ == '__main__':
    main()
