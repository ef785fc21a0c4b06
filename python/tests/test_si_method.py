"""The SpikeInterface method: detect_peaks(rec, method="spikecube") and
spikecube.spikeinterface.detect against `spikecube detect` on the same data."""

import json
from pathlib import Path

import numpy as np
import pytest

si = pytest.importorskip("spikeinterface")
import spikeinterface.core as sc  # noqa: E402
import spikeinterface.extractors as se  # noqa: E402
from spikeinterface.sortingcomponents.peak_detection import detect_peaks  # noqa: E402

import spikecube  # noqa: E402
import spikecube.spikeinterface as ssi  # noqa: E402
from conftest import cli_detect, load_npy  # noqa: E402
from test_api import nearest_offsets  # noqa: E402

OFFSET = spikecube.TROUGH_OFFSET


def simulated_as_binary(sim):
    """The simulated SpikeGLX file through read_binary: 385 int16 columns, the
    384 data channels with probe.json's positions."""
    p = json.loads((sim / "probe.json").read_text())
    rec = se.read_binary(sim / "sim_g0_t0.imec0.ap.bin", sampling_frequency=30000.0,
                         dtype="int16", num_channels=385)
    rec = rec.select_channels(rec.channel_ids[np.asarray(p["chanMap"])])
    rec.set_dummy_probe_from_locations(np.stack([p["xc"], p["yc"]], 1))
    return rec


def spikes(folder):
    """(time, centre) of every spike of an output folder, sorted."""
    t = load_npy(folder, "spike_times.npy")
    c = load_npy(folder, "spike_centers.npy")
    return np.stack([t, c], 1)[np.lexsort((c, t))]


def of_peaks(peaks):
    t = peaks["sample_index"].astype(np.int64) + OFFSET
    c = peaks["center"].astype(np.int64)
    return np.stack([t, c], 1)[np.lexsort((c, t))]


def test_registered():
    assert ssi.detect_peak_methods["spikecube"] is ssi.SpikecubePeakDetector
    with pytest.raises(ValueError, match="nearest_chans"):
        ssi.SpikecubePeakDetector(sc.generate_recording(num_channels=4, durations=[1.0]), Th_univresal=8)


@pytest.fixture(scope="module")
def sim_peaks(sim):
    rec = simulated_as_binary(sim)
    return {
        n: detect_peaks(rec, method="spikecube", job_kwargs=dict(chunk_size=60000, n_jobs=n, progress_bar=False))
        for n in (1, 2)
    }


def test_detect_peaks_equals_command_line(sim_peaks, sim_cli_keep):
    peaks = sim_peaks[1]
    assert peaks.dtype == ssi.peak_dtype
    assert len(peaks) > 100
    np.testing.assert_array_equal(of_peaks(peaks), spikes(sim_cli_keep))
    # SpikeInterface's own peak fields: the command line's peaks.npy (same
    # trough and channel); amplitudes are the raw trace values there.
    ref = load_npy(sim_cli_keep, "peaks.npy")
    order = np.lexsort((peaks["center"], peaks["sample_index"]))
    np.testing.assert_array_equal(peaks["sample_index"][order], ref["sample_index"])
    np.testing.assert_array_equal(peaks["channel_index"][order], ref["channel_index"])
    assert np.all(peaks["amplitude"][peaks["sign"] > 0] < 0)


def test_n_jobs_does_not_change_peaks(sim_peaks):
    a, b = sim_peaks[1], sim_peaks[2]
    oa = np.lexsort((a["center"], a["sample_index"]))
    ob = np.lexsort((b["center"], b["sample_index"]))
    np.testing.assert_array_equal(a[oa], b[ob])


def test_peaks_on_true_trough(sim_peaks, sim):
    peaks = sim_peaks[1]
    d = nearest_offsets(peaks["sample_index"], peaks["y"], np.load(sim / "ground_truth.npy"))
    assert d.size > 0.9 * len(peaks)
    assert np.median(d) == 0


def test_localize_peaks_within_5_um(sim_peaks, sim):
    from spikeinterface.sortingcomponents.peak_localization import localize_peaks

    rec = simulated_as_binary(sim)
    peaks = sim_peaks[1]
    base = np.zeros(len(peaks), dtype=sc.base_peak_dtype if hasattr(sc, "base_peak_dtype") else
                    [("sample_index", "int64"), ("channel_index", "int64"), ("amplitude", "float64"),
                     ("segment_index", "int64")])
    for f in base.dtype.names:
        base[f] = peaks[f]
    locs = localize_peaks(rec, base, method="monopolar_triangulation",
                          job_kwargs=dict(n_jobs=1, progress_bar=False))
    gt = np.load(sim / "ground_truth.npy")
    tt = gt[np.argsort(gt[:, 0])]
    err = []
    for p, l in zip(peaks, locs):
        i = np.searchsorted(tt[:, 0], p["sample_index"])
        near = [k for k in range(max(0, i - 3), min(len(tt), i + 3)) if abs(tt[k, 0] - p["sample_index"]) <= 2]
        if near:
            err.append(min(np.hypot(l["x"] - tt[k, 1], l["y"] - tt[k, 2]) for k in near))
    err = np.asarray(err)
    assert err.size > 0.9 * len(peaks)
    assert np.median(err) <= 5.0, np.median(err)


@pytest.fixture(scope="module")
def ground_truth_recording(tmp_path_factory):
    rec, sorting = sc.generate_ground_truth_recording(
        durations=[9.0], sampling_frequency=30000.0, num_channels=32, num_units=10, seed=2205
    )
    d = tmp_path_factory.mktemp("gt")
    saved = rec.save(folder=d / "saved", format="binary", n_jobs=1, progress_bar=False)
    locs = rec.get_channel_locations()
    n = rec.get_num_channels()
    probe = d / "probe.json"
    probe.write_text(json.dumps({"chanMap": list(range(n)), "xc": locs[:, 0].tolist(),
                                 "yc": locs[:, 1].tolist(), "kcoords": [0] * n, "n_chan": n}))
    raw = Path(saved.get_binary_description()["file_paths"][0])
    return rec, saved, raw, probe


def test_ground_truth_recording_chunked_equals_command_line(ground_truth_recording, tmp_path):
    rec, saved, raw, probe = ground_truth_recording
    n = rec.get_num_channels()
    peaks = detect_peaks(rec, method="spikecube", job_kwargs=dict(chunk_size=60000, n_jobs=1, progress_bar=False))
    folder = cli_detect(raw, tmp_path / "c", "--n-channels", n, "--fs", 30000, "--dtype", "float32",
                        "--probe", probe, "--keep-boundary-duplicates",
                        "--templates-from-data", "false", "--nblocks", "0")
    assert len(peaks) > 50
    np.testing.assert_array_equal(of_peaks(peaks), spikes(folder))


def test_fast_path_equals_command_line(ground_truth_recording, tmp_path):
    rec, saved, raw, probe = ground_truth_recording
    n = rec.get_num_channels()
    assert ssi._binary_file(saved) is not None and ssi._binary_file(rec) is None
    peaks = ssi.detect(saved, progress=False, backend="cpu")
    folder = cli_detect(raw, tmp_path / "c", "--n-channels", n, "--fs", 30000, "--dtype", "float32",
                        "--probe", probe)
    np.testing.assert_array_equal(of_peaks(peaks), spikes(folder))
    traces = saved.get_traces()
    np.testing.assert_array_equal(peaks["amplitude"],
                                  traces[peaks["sample_index"], peaks["channel_index"]].astype(np.float64))


def test_other_chunk_sizes_give_nearly_the_same_spikes(ground_truth_recording, tmp_path):
    # Chunks of 1 s (SpikeInterface's default) are windows of 30 000 samples:
    # the same preprocessing on other windows, so nearly the same spikes.
    rec, saved, raw, probe = ground_truth_recording
    n = rec.get_num_channels()
    peaks = detect_peaks(rec, method="spikecube", job_kwargs=dict(chunk_size=30000, n_jobs=1, progress_bar=False))
    folder = cli_detect(raw, tmp_path / "c", "--n-channels", n, "--fs", 30000, "--dtype", "float32",
                        "--probe", probe, "--keep-boundary-duplicates",
                        "--templates-from-data", "false", "--nblocks", "0")
    ref = set(map(tuple, spikes(folder)))
    got = set(map(tuple, of_peaks(peaks)))
    assert len(ref & got) >= 0.95 * len(ref), (len(ref & got), len(ref), len(got))
    assert len(ref & got) >= 0.95 * len(got)
