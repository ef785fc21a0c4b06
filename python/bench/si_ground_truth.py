"""Recall and precision of peak detectors on a SpikeInterface ground-truth
recording, and the speed of spikecube's Python paths against the command line.

    pip install dist/spikecube-*.whl spikeinterface numba
    python python/bench/si_ground_truth.py [--seconds 120] [--channels 64] [--bin target/release/spikecube]

The recording: spikeinterface.core.generate_ground_truth_recording (seed 2205),
preprocessed the same way for every detector (SpikeInterface's detectors get
a 300 Hz high-pass, median common reference and noise levels, as they expect;
spikecube gets the raw traces and does its own preprocessing, as Kilosort4
does). A detected peak matches a true spike when it lies within ±0.4 ms
(SpikeInterface's default `delta_time` for comparisons) and no other peak has
matched that spike (greedy, nearest first). Recall = matched true spikes / true
spikes; precision = matched peaks / peaks.
"""

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np


def match(peaks_t, true_t, tol):
    """Greedy one-to-one matching within tol samples, nearest pairs first."""
    peaks_t = np.sort(peaks_t)
    true_t = np.sort(true_t)
    pairs = []
    for k, t in enumerate(true_t):
        i = np.searchsorted(peaks_t, t)
        for j in range(max(0, i - 4), min(len(peaks_t), i + 4)):
            d = abs(int(peaks_t[j]) - int(t))
            if d <= tol:
                pairs.append((d, k, j))
    pairs.sort()
    used_t, used_p = set(), set()
    for d, k, j in pairs:
        if k not in used_t and j not in used_p:
            used_t.add(k)
            used_p.add(j)
    return len(used_t) / max(1, len(true_t)), len(used_p) / max(1, len(peaks_t))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--channels", type=int, default=64)
    ap.add_argument("--units", type=int, default=20)
    ap.add_argument("--bin", default=str(Path(__file__).resolve().parents[2] / "target" / "release" / "spikecube"))
    ap.add_argument("--n-jobs", type=int, default=os.cpu_count())
    args = ap.parse_args()

    import spikeinterface.core as sc
    import spikeinterface.preprocessing as spre
    from spikeinterface.sortingcomponents.peak_detection import detect_peaks
    import spikecube
    import spikecube.spikeinterface as ssi

    fs = 30000.0
    rec, sorting = sc.generate_ground_truth_recording(
        durations=[args.seconds], sampling_frequency=fs, num_channels=args.channels,
        num_units=args.units, seed=2205,
    )
    tmp = Path(tempfile.mkdtemp(prefix="spikecube-bench-"))
    saved = rec.save(folder=tmp / "saved", format="binary", n_jobs=1, progress_bar=False)
    raw = saved.get_binary_description()["file_paths"][0]
    locs = rec.get_channel_locations()
    n = rec.get_num_channels()
    probe = tmp / "probe.json"
    probe.write_text(json.dumps({"chanMap": list(range(n)), "xc": locs[:, 0].tolist(),
                                 "yc": locs[:, 1].tolist(), "kcoords": [0] * n, "n_chan": n}))
    true_t = sorting.to_spike_vector()["sample_index"]
    tol = int(round(0.4e-3 * fs))
    jk = dict(n_jobs=args.n_jobs, chunk_duration="1s", progress_bar=False)
    results = {}

    t0 = time.perf_counter()
    subprocess.run([args.bin, "detect", raw, "--n-channels", str(n), "--fs", str(fs), "--dtype", "float32",
                    "--probe", str(probe), "--out", str(tmp / "cli"), "-q", "--backend", "cpu"], check=True)
    t_cli = time.perf_counter() - t0
    cli_t = np.load(tmp / "cli" / "peaks.npy")["sample_index"]
    results["spikecube (command line)"] = (*match(cli_t, true_t, tol), len(cli_t), t_cli)

    t0 = time.perf_counter()
    fast = ssi.detect(saved, progress=False, backend="cpu")
    t_fast = time.perf_counter() - t0
    results["spikecube fast path (spikecube.spikeinterface.detect)"] = (
        *match(fast["sample_index"], true_t, tol), len(fast), t_fast)

    for nj in sorted({1, args.n_jobs}):
        t0 = time.perf_counter()
        ch = detect_peaks(rec, method="spikecube",
                          job_kwargs=dict(n_jobs=nj, chunk_size=60000, progress_bar=False))
        t_ch = time.perf_counter() - t0
        results[f"spikecube chunked (detect_peaks, n_jobs={nj})"] = (
            *match(ch["sample_index"], true_t, tol), len(ch), t_ch)

    pre = spre.common_reference(spre.highpass_filter(rec, freq_min=300.0), operator="median")
    noise = sc.get_noise_levels(pre, return_in_uV=False)
    for th in (5, 8):
        t0 = time.perf_counter()
        le = detect_peaks(pre, method="locally_exclusive",
                          method_kwargs=dict(noise_levels=noise, detect_threshold=th, radius_um=50),
                          job_kwargs=jk)
        results[f"SpikeInterface locally_exclusive (threshold {th} MAD)"] = (
            *match(le["sample_index"], true_t, tol), len(le), time.perf_counter() - t0)
    from spikeinterface.sortingcomponents.tools import get_prototype_and_waveforms_from_recording

    ms_before = 0.5
    proto, _, _ = get_prototype_and_waveforms_from_recording(
        pre, n_peaks=5000, ms_before=ms_before, ms_after=1.0, seed=0, job_kwargs=jk,
        noise_levels=noise)
    t0 = time.perf_counter()
    mf = detect_peaks(pre, method="matched_filtering",
                      method_kwargs=dict(prototype=proto, ms_before=ms_before, detect_threshold=5,
                                         radius_um=50),
                      job_kwargs=jk)
    results["SpikeInterface matched_filtering (threshold 5)"] = (
        *match(mf["sample_index"], true_t, tol), len(mf), time.perf_counter() - t0)

    print(f"recording: {args.seconds:.0f} s, {n} channels, {args.units} units, {len(true_t)} true spikes; "
          f"match within ±{tol} samples; {os.cpu_count()} cores")
    print("| detector | recall | precision | peaks | wall s | × realtime |")
    print("|---|---|---|---|---|---|")
    for k, (r, p, npk, w) in results.items():
        print(f"| {k} | {r:.3f} | {p:.3f} | {npk} | {w:.1f} | {args.seconds / w:.1f} |")


if __name__ == "__main__":
    main()
