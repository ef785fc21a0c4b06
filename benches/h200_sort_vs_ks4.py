#!/usr/bin/env python3
"""`spikecube sort` and Kilosort4 4.1.7's `run_kilosort` on one recording, in one device call.

Usage: h200_sort_vs_ks4.py SPIKECUBE_BINARY SORT_H200_PY OUTDIR [--cuda-runs N] [--cpu-runs N]
       [--cpu-threads N] [--no-ks4] [--env NAME=VALUE ...] [--cpu-env NAME=VALUE[,...] ...]

1. Makes the 10-minute, 384-site, 400-unit simulation of `SORT_H200_PY`
   (`../shared/tools/ks4ref/sort_h200.py`, its seeds) once, in /tmp/sim
   (rec.bin, probe.json, the ground truth), unless it is there, with torch's
   deterministic algorithms on (the script's CUDA index_add_ otherwise sums
   overlapping spikes in any order, and no two runs write the same file);
   rec.bin's hash goes into results.json (`rec_sha1`).
2. Sorts it with spikecube: one CUDA run that fills the kernel cache, then
   `--cuda-runs` CUDA runs and `--cpu-runs` CPU runs (`--threads`
   `--cpu-threads`). Each run is a child process timed through `wait4` (wall,
   peak resident memory), with `nvidia-smi` read every 100 ms for the GPU's
   memory in use (the peak above the reading before the run is the run's).
3. Runs Kilosort4 through SORT_H200_PY's stage timers on the same file (its
   run A only), in a child process.

Writes OUTDIR/results.json (spikecube's runs: wall, peak memory, the sort's
stage seconds, counts, and whether every run wrote the same bytes as the
first CUDA run), OUTDIR/sc_cuda.npz and sc_cpu.npz (spike times, clusters,
good units), OUTDIR/gt.npz (the simulation's spikes), and Kilosort4's
summary.json, spikes_A.npz and log_A.txt under OUTDIR/ks4/.
"""
import argparse, hashlib, json, os, pickle, shutil, subprocess, sys, threading, time
from pathlib import Path

import numpy as np

SIM = Path('/tmp/sim')
T0 = time.time()
COMPARED = ['spike_times.npy', 'spike_clusters.npy', 'amplitudes.npy', 'pc_features.npy',
            'templates.npy', 'similar_templates.npy']


def simulate(ks4py):
    rec = SIM / 'rec.bin'
    if (SIM / 'sim.pkl').exists():
        return
    SIM.mkdir(exist_ok=True)
    sys.path.insert(0, str(Path(ks4py).resolve().parent))
    sys.argv = [ks4py, '/tmp/ks4_unused', '600', '400']
    import sort_h200 as s
    import torch
    t0 = time.time()
    # The script adds the spikes with torch's index_add_, whose CUDA atomics sum
    # overlapping waveforms in any order: two runs of it, on one machine too,
    # write files that differ in a few samples. torch's deterministic mode
    # makes that sum ordered, so every call sorts the same recording.
    torch.use_deterministic_algorithms(True)
    try:
        probe, times, units, info = s.simulate(rec)
    finally:
        torch.use_deterministic_algorithms(False)
    h = digest(rec)
    (SIM / 'rec.sha1').write_text(h)
    print(f'simulated {times.size} spikes in {time.time() - t0:.1f} s (rec.bin {h})', flush=True)
    with open(SIM / 'sim.pkl', 'wb') as f:
        pickle.dump((probe, times, units, info), f)
    json.dump({k: (np.asarray(v).tolist() if hasattr(v, '__len__') else v) for k, v in probe.items()},
              open(SIM / 'probe.json', 'w'))


class GpuMemory:
    """Samples nvidia-smi's memory.used (MiB) every 100 ms while a run goes on."""

    def __init__(self):
        self.peak = 0
        self.base = self.read()
        self.proc = self.thread = None
        if shutil.which('nvidia-smi'):
            self.proc = subprocess.Popen(['nvidia-smi', '--query-gpu=memory.used', '--format=csv,noheader,nounits',
                                          '-lms', '100'], stdout=subprocess.PIPE, text=True)
            self.thread = threading.Thread(target=self.follow, daemon=True)
            self.thread.start()

    @staticmethod
    def read():
        try:
            out = subprocess.run(['nvidia-smi', '--query-gpu=memory.used', '--format=csv,noheader,nounits'],
                                 capture_output=True, text=True).stdout
            return int(out.split()[0])
        except Exception:
            return -1

    def follow(self):
        for line in self.proc.stdout:
            try:
                self.peak = max(self.peak, int(line.strip()))
            except ValueError:
                pass

    def stop(self):
        if self.proc is None:
            return -1, self.base
        self.proc.terminate()
        self.proc.wait()
        self.thread.join(timeout=2)
        return self.peak, self.base


def digest(path):
    return hashlib.sha1(path.read_bytes()).hexdigest()[:16] if path.exists() else None


def sort_run(binary, name, backend, threads, env, work):
    out = work / f'o_{name}'
    if out.exists():
        shutil.rmtree(out)
    log = work / f'log_{name}.txt'
    cmd = [binary, 'sort', str(SIM / 'rec.bin'), '--n-channels', '384', '--fs', '30000', '--dtype', 'int16',
           '--probe', str(SIM / 'probe.json'), '--json', '--backend', backend, '--out', str(out)]
    if threads:
        cmd += ['--threads', str(threads)]
    env = dict(env)
    cmd += env.pop('ARGS', '').split()
    gpu = GpuMemory()
    t0 = time.time()
    with open(log, 'w') as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **env})
        _, status, usage = os.wait4(p.pid, 0)
    wall = time.time() - t0
    peak, base = gpu.stop()
    r = dict(name=name, backend=backend, threads=threads, env=env, exit=os.waitstatus_to_exitcode(status),
             wall_s=round(wall, 3), peak_rss_gb=round(usage.ru_maxrss / 1e6, 3),
             gpu_mib_before=base, gpu_mib_peak=peak, user_s=round(usage.ru_utime, 2), sys_s=round(usage.ru_stime, 2))
    meta = out / 'spikecube.json'
    if meta.exists():
        m = json.load(open(meta))
        r['timings_s'] = {k: round(v, 3) for k, v in m.get('timings_s', {}).items()}
        r['counts'] = m.get('counts')
        r['detection_timings_s'] = {k: round(v, 6 if 'median' in k else 3) for k, v in m.get('detection', {}).get('timings_s', {}).items()
                                    if isinstance(v, (int, float))}
        r['sha1'] = {f: digest(out / f) for f in COMPARED}
    else:
        r['log_tail'] = log.read_text()[-3000:]
    print(json.dumps({k: r[k] for k in ('name', 'exit', 'wall_s', 'peak_rss_gb', 'gpu_mib_peak') if k in r},),
          r.get('timings_s'), flush=True)
    return r


def save_spikes(folder, dest):
    st = np.load(folder / 'spike_times.npy').ravel()
    cl = np.load(folder / 'spike_clusters.npy').ravel()
    lab = [l.split('\t') for l in (folder / 'cluster_KSLabel.tsv').read_text().splitlines()[1:]]
    good = np.array([int(c) for c, g in lab if g == 'good'], np.int32)
    np.savez_compressed(dest, st=st.astype(np.int64), clu=cl.astype(np.int32), good=good)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('binary'); ap.add_argument('ks4py'); ap.add_argument('out')
    ap.add_argument('--cuda-runs', type=int, default=3); ap.add_argument('--cpu-runs', type=int, default=1)
    ap.add_argument('--cpu-threads', type=int, default=16); ap.add_argument('--no-ks4', action='store_true')
    ap.add_argument('--ks4-only', action='store_true'); ap.add_argument('--env', action='append', default=[])
    ap.add_argument('--ks4-first', action='store_true', help='run Kilosort4 before spikecube')
    ap.add_argument('--budget-s', type=float, default=1e9,
                    help='skip a spikecube run that would end past this many seconds from the start '
                         '(a CUDA run counted as 25 s, a CPU run as 90 s)')
    ap.add_argument('--cpu-env', action='append', default=[],
                    help='NAME=VALUE[,NAME=VALUE]: one CPU run a round with these settings (repeatable)')
    a = ap.parse_args()
    out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    if a.ks4_only:
        sys.path.insert(0, str(Path(a.ks4py).resolve().parent))
        sys.argv = [a.ks4py, str(out / 'ks4'), '600', '400']
        os.environ['B_IF_BELOW'] = '0'
        # No network there: Kilosort4 reads its built-in templates from its downloads
        # folder, seeded with the copy its wheel ships (read when kilosort is imported).
        import importlib.util
        downloads = Path('/tmp/ks4_downloads'); downloads.mkdir(exist_ok=True)
        os.environ['KILOSORT_LOCAL_DOWNLOADS_PATH'] = str(downloads)
        packaged = Path(importlib.util.find_spec('kilosort').origin).parent / 'wTEMP.npz'
        if not (downloads / 'wTEMP.npz').exists():
            shutil.copyfile(packaged, downloads / 'wTEMP.npz')
        import sort_h200 as s
        cached = pickle.load(open(SIM / 'sim.pkl', 'rb'))
        s.simulate = lambda path: cached
        s.main()
        return
    simulate(a.ks4py)
    _, times, units, _ = pickle.load(open(SIM / 'sim.pkl', 'rb'))
    np.savez_compressed(out / 'gt.npz', times=times, units=units)
    if a.ks4_first and not a.no_ks4:
        kilosort4(a, out)
    work = Path('/tmp/sc_runs'); work.mkdir(exist_ok=True)
    env = dict(e.split('=', 1) for e in a.env)
    runs = []

    def add(r):  # results.json after every run, so that a call cut short keeps what ran
        if r is None:
            return
        runs.append(r)
        first = runs[0].get('sha1')
        for q in runs:
            q['same_bytes_as_cuda_warm'] = ({f: q.get('sha1', {}).get(f) == first.get(f) for f in COMPARED}
                                            if first else None)
        rec_sha1 = (SIM / 'rec.sha1').read_text() if (SIM / 'rec.sha1').exists() else None
        json.dump(dict(runs=runs, nproc=os.cpu_count(), rec_sha1=rec_sha1), open(out / 'results.json', 'w'), indent=1)

    def fits(backend):
        left = a.budget_s - (time.time() - T0)
        if left < (25 if backend == 'cuda' else 90):
            print(f'skipped a {backend} run: {left:.0f} s left of --budget-s', flush=True)
            return False
        return True

    add(sort_run(a.binary, 'cuda_warm', 'cuda', None, env, work) if fits('cuda') else None)
    for i in range(a.cuda_runs):
        add(sort_run(a.binary, f'cuda{i + 1}', 'cuda', None, env, work) if fits('cuda') else None)
    variants = [dict(e.split('=', 1) for e in v.split(',')) for v in a.cpu_env] or [{}]
    for i in range(a.cpu_runs):
        for k, v in enumerate(variants):
            name = f'cpu{i + 1}' if len(variants) == 1 else f'cpu{i + 1}_{k}'
            add(sort_run(a.binary, name, 'cpu', a.cpu_threads, {**env, **v}, work) if fits('cpu') else None)
    if (work / 'o_cuda1').exists():
        save_spikes(work / 'o_cuda1', out / 'sc_cuda.npz')
        shutil.copy(work / 'log_cuda1.txt', out / 'sc_cuda_log.txt')
    for cpu in ('o_cpu1', 'o_cpu1_0'):
        if (work / cpu).exists():
            save_spikes(work / cpu, out / 'sc_cpu.npz')
    if not a.ks4_first and not a.no_ks4:
        kilosort4(a, out)


def kilosort4(a, out):
    t0 = time.time()
    subprocess.run([sys.executable, __file__, a.binary, a.ks4py, str(out), '--ks4-only'])
    print(f'Kilosort4 process: {time.time() - t0:.1f} s', flush=True)
    (out / 'ks4' / 'gt.npz').unlink(missing_ok=True)


if __name__ == '__main__':
    main()
