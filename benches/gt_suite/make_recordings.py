"""Ground-truth recordings for the sort suite (benches/gt_suite/run.sh).

Usage: make_recordings.py ROOT NAME [--seconds S] [--n-units N] [--n-jobs J]
                          [--n-channels C] [--spikecube BIN] [--seed SEED]

NAME is one of (C sites, 384 by default; fewer only for quick local tests)
  sim       `spikecube simulate` (Neuropixels 2.0-like single shank: its
            default probe for 384 sites, else the first C of its sites; a
            SpikeGLX file of C + 1 columns: the sites, then the sync channel);
  si_gt     SpikeInterface `generate_ground_truth_recording` (384 sites,
            Neuropixels 1.0-like staggered layout, static);
  si_drift  SpikeInterface `generate_drifting_recording` (same layout, a rigid
            zigzag drift of 50 um peak to peak: +-25 um, period 2/3 of the
            recording, starting at 1/5 of it; templates made every 2 um of
            displacement, SpikeInterface's default being 1 um: half the
            template-making time, and 2 um is a tenth of the row pitch).

Writes ROOT/NAME/:
  rec.bin     int16, time-major (samples x columns interleaved), no header;
  probe.json  the probe in Kilosort's JSON format (chanMap, xc, yc, kcoords,
              n_chan); chanMap gives each site's file column, n_chan the
              file's column count;
  gt.npz      st (int64, trough sample of each true spike, sorted) and unit
              (int32, its unit, numbered from 0);
  meta.json   fs, n_chan_bin, seconds, n_units, n_spikes, the generator and
              its settings, the package versions, and the wall seconds of
              each step.

SpikeInterface's recordings are float32 in uV; they are written as
round(2 * uV) (0.5 uV per count: noise of 5-8 uV is 10-16 counts, as in
spikecube's simulation, and the rounding adds < 0.3 count sd). The spike
times of SpikeInterface's ground truth are the template's trough sample
(`nbefore`), as spikecube's simulation's are.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

FS = 30000.0
GAIN = 2.0  # counts per uV for SpikeInterface's float32 recordings


def np1_like_probe_kwargs(n_channels=384):
    """Neuropixels 1.0-like layout (n_channels sites, a multiple of 4): four
    columns 16 um apart (x = 0, 16, 32, 48 um), each site 40 um above the one
    below in its column, columns 1 and 3 shifted up by 20 um: two sites every
    20 um, staggered, as Neuropixels 1.0's checkerboard."""
    if n_channels % 4:
        sys.exit(f'--n-channels {n_channels} is not a multiple of 4')
    return dict(num_columns=4, num_contact_per_column=n_channels // 4, xpitch=16.0, ypitch=40.0,
                y_shift_per_column=[0.0, 20.0, 0.0, 20.0], contact_shapes='square',
                contact_shape_params={'width': 12.0})


def write_kilosort_probe(path, xy, n_chan, chan_map=None):
    """Kilosort JSON probe: site i at xy[i], read from file column chan_map[i]."""
    n = len(xy)
    chan_map = np.arange(n) if chan_map is None else np.asarray(chan_map)
    d = {'chanMap': [int(c) for c in chan_map], 'xc': [float(v) for v in xy[:, 0]],
         'yc': [float(v) for v in xy[:, 1]], 'kcoords': [0.0] * n, 'n_chan': int(n_chan)}
    Path(path).write_text(json.dumps(d))


def versions():
    v = {'python': platform.python_version(), 'numpy': np.__version__}
    for m in ('spikeinterface', 'probeinterface'):
        try:
            v[m] = __import__(m).__version__
        except ImportError:
            pass
    return v


def make_sim(out, seconds, n_units, seed, n_channels, spikecube, timings):
    """spikecube simulate: writes its SpikeGLX folder under out/spikecube_sim,
    then rec.bin (a hard link or copy of its .bin), probe.json and gt.npz."""
    raw = out / 'spikecube_sim'
    t0 = time.time()
    cmd = [spikecube, 'simulate', '--seconds', str(seconds), '--n-units', str(n_units),
           '--seed', str(seed), '--out', str(raw), '-q']
    if n_channels != 384:
        # The default probe's first n_channels sites (x = 32 (i mod 2), y = 15 floor(i / 2)).
        i = np.arange(n_channels)
        xy = np.stack([32.0 * (i % 2), 15.0 * (i // 2)], 1)
        write_kilosort_probe(out / 'sim_probe.json', xy, n_channels)
        cmd += ['--probe', str(out / 'sim_probe.json')]
    subprocess.run(cmd, check=True)
    timings['simulate'] = time.time() - t0
    t0 = time.time()
    rec = out / 'rec.bin'
    if rec.exists():
        rec.unlink()
    binf = raw / 'sim_g0_t0.imec0.ap.bin'
    try:
        os.link(binf, rec)
    except OSError:
        import shutil
        shutil.copyfile(binf, rec)
    p = json.loads((raw / 'probe.json').read_text())
    xy = np.stack([np.asarray(p['xc'], float), np.asarray(p['yc'], float)], 1)
    write_kilosort_probe(out / 'probe.json', xy, p['n_chan'], p['chanMap'])
    gt = np.load(raw / 'ground_truth.npy')
    units_path = raw / 'ground_truth_units.npy'
    if not units_path.exists():
        sys.exit(f'{units_path} is missing: this spikecube build predates ground_truth_units.npy')
    unit = np.load(units_path).astype(np.int32)
    st = np.rint(gt[:, 0]).astype(np.int64)
    o = np.argsort(st, kind='stable')
    np.savez(out / 'gt.npz', st=st[o], unit=unit[o])
    timings['ground_truth'] = time.time() - t0
    return {'generator': 'spikecube simulate', 'command': ' '.join(cmd), 'n_chan_bin': int(p['n_chan']),
            'n_sites': len(xy), 'n_units': int(n_units), 'n_spikes': int(st.size),
            'layout': 'Neuropixels 2.0-like: x in {0, 32} um, rows every 15 um; the last column is the sync channel'}


def write_si(rec, sorting, out, n_jobs, timings, info):
    """Writes a SpikeInterface recording as rec.bin (round(GAIN * uV), int16),
    its probe and the sorting's spike trains. Chunks of 3 s: the noise is
    made in 1-s blocks and a chunk makes every block it touches, including
    the one its end touches, so 3-s chunks make 4 blocks per 3 s where 1-s
    chunks would make 2 per 1 s."""
    import spikeinterface.core as sc
    from spikeinterface.preprocessing import scale
    t0 = time.time()
    sv = sorting.to_spike_vector()
    st = sv['sample_index'].astype(np.int64)
    unit = sv['unit_index'].astype(np.int32)
    o = np.argsort(st, kind='stable')
    np.savez(out / 'gt.npz', st=st[o], unit=unit[o])
    xy = rec.get_channel_locations()[:, :2]
    write_kilosort_probe(out / 'probe.json', xy, rec.get_num_channels())
    timings['ground_truth'] = time.time() - t0
    t0 = time.time()
    scaled = scale(rec, gain=GAIN, offset=0.0, dtype='int16')
    path = out / 'rec.bin'
    sc.write_binary_recording(scaled, file_paths=[path], dtype='int16', n_jobs=n_jobs,
                              chunk_duration='3s', progress_bar=False, mp_context='fork',
                              pool_engine='process', max_threads_per_worker=1)
    timings['write_binary'] = time.time() - t0
    info.update({'n_chan_bin': int(rec.get_num_channels()), 'n_sites': int(rec.get_num_channels()),
                 'n_units': int(sorting.get_num_units()), 'n_spikes': int(st.size),
                 'counts_per_uV': GAIN})
    return info


def make_si_gt(out, seconds, n_units, seed, n_channels, n_jobs, timings):
    from spikeinterface.core import generate_ground_truth_recording
    t0 = time.time()
    kw = dict(durations=[seconds], sampling_frequency=FS, num_channels=n_channels, num_units=n_units,
              generate_probe_kwargs=np1_like_probe_kwargs(n_channels), seed=seed)
    rec, sorting = generate_ground_truth_recording(**kw)
    timings['generate'] = time.time() - t0
    info = {'generator': 'spikeinterface.core.generate_ground_truth_recording',
            'settings': {k: v for k, v in kw.items() if k != 'durations'} | {'seconds': seconds,
                                                                               'other': 'SpikeInterface defaults'},
            'layout': 'Neuropixels 1.0-like: 4 columns x in {0, 16, 32, 48} um, 2 sites every 20 um, staggered'}
    return write_si(rec, sorting, out, n_jobs, timings, info)


def make_si_drift(out, seconds, n_units, seed, n_channels, n_jobs, timings):
    from spikeinterface.generation import generate_drifting_recording
    t0 = time.time()
    motion = dict(drift_mode='zigzag', non_rigid_gradient=None, t_start_drift=seconds / 5.0,
                  t_end_drift=None, period_s=seconds * 2.0 / 3.0)
    dkw = dict(displacement_sampling_frequency=5.0, drift_start_um=[0.0, 25.0], drift_stop_um=[0.0, -25.0],
               drift_step_um=2.0, motion_list=[motion])
    _static, rec, sorting, extra = generate_drifting_recording(
        num_units=n_units, duration=seconds, sampling_frequency=FS,
        generate_probe_kwargs=np1_like_probe_kwargs(n_channels), generate_displacement_vector_kwargs=dkw,
        extra_outputs=True, seed=seed)
    timings['generate'] = time.time() - t0
    dv = np.asarray(extra['displacement_vectors'])
    np.savez(out / 'drift_truth.npz', displacement_vectors=dv.astype(np.float32),
             displacement_sampling_frequency=float(extra['displacement_sampling_frequency']))
    info = {'generator': 'spikeinterface.generation.generate_drifting_recording',
            'settings': {'num_units': n_units, 'seconds': seconds, 'seed': seed,
                         'displacement': {k: v for k, v in dkw.items()}, 'other': 'SpikeInterface defaults'},
            'drift_um_range': [float(dv[:, 1].min()), float(dv[:, 1].max())],
            'layout': 'Neuropixels 1.0-like: 4 columns x in {0, 16, 32, 48} um, 2 sites every 20 um, staggered'}
    return write_si(rec, sorting, out, n_jobs, timings, info)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('root', type=Path)
    ap.add_argument('name', choices=['sim', 'si_gt', 'si_drift'])
    ap.add_argument('--seconds', type=float, default=300.0)
    ap.add_argument('--n-units', type=int, default=150)
    ap.add_argument('--n-jobs', type=int, default=16)
    ap.add_argument('--n-channels', type=int, default=384)
    ap.add_argument('--seed', type=int, default=2026)
    ap.add_argument('--spikecube', default='spikecube')
    a = ap.parse_args()
    out = a.root / a.name
    out.mkdir(parents=True, exist_ok=True)
    t_all = time.time()
    timings = {}
    if a.name == 'sim':
        info = make_sim(out, a.seconds, a.n_units, a.seed, a.n_channels, a.spikecube, timings)
    elif a.name == 'si_gt':
        info = make_si_gt(out, a.seconds, a.n_units, a.seed, a.n_channels, a.n_jobs, timings)
    else:
        info = make_si_drift(out, a.seconds, a.n_units, a.seed, a.n_channels, a.n_jobs, timings)
    timings['total'] = time.time() - t_all
    size = (out / 'rec.bin').stat().st_size
    n_samples = size // (2 * info['n_chan_bin'])
    assert n_samples * 2 * info['n_chan_bin'] == size, 'rec.bin is not whole frames'
    meta = {'name': a.name, 'fs': FS, 'seconds': n_samples / FS, 'n_samples': int(n_samples),
            'dtype': 'int16', **info, 'n_jobs': a.n_jobs, 'versions': versions(), 'wall_s': timings}
    (out / 'meta.json').write_text(json.dumps(meta, indent=1, default=str))
    print(f"{a.name}: {meta['n_units']} units, {meta['n_spikes']} spikes, {meta['seconds']:.1f} s x "
          f"{info['n_chan_bin']} columns; " + ', '.join(f'{k} {v:.1f} s' for k, v in timings.items()), flush=True)


if __name__ == '__main__':
    main()
