"""spikecube's Python API against the command line on the same files."""

import json
import logging
import os
import signal
from pathlib import Path

import numpy as np
import pytest

import spikecube
from conftest import cli, cli_detect, load_npy

FILES = {
    "times": "spike_times.npy",
    "centers": "spike_centers.npy",
    "amplitudes": "amplitudes.npy",
    "templates": "spike_detection_templates.npy",
    "signs": "spike_signs.npy",
    "positions": "spike_positions.npy",
    "pc_features": "pc_features.npy",
    "pc_feature_ind": "pc_feature_ind.npy",
    "peaks": "peaks.npy",
    "whitening_mat": "whitening_mat.npy",
}


def assert_same(r, folder):
    for attr, name in FILES.items():
        np.testing.assert_array_equal(getattr(r, attr), load_npy(folder, name), err_msg=name)


def test_detect_equals_command_line(sim_bin, sim_cli):
    r = spikecube.detect(sim_bin, progress=False)
    assert len(r) > 100
    assert r.path is None
    assert r.fs == 30000.0
    assert r.times.dtype == np.int64 and r.positions.shape == (len(r), 2)
    assert_same(r, sim_cli)


def test_settings_by_kilosort_names(sim_bin, tmp_path):
    r = spikecube.detect(sim_bin, progress=False, Th_universal=12, batch_size=40000, nearest_chans=8)
    folder = cli_detect(sim_bin, tmp_path / "c", "--th-universal", "12", "--batch-size", "40000",
                        "--nearest-chans", "8")
    assert_same(r, folder)
    assert r.pc_features.shape[1] == 8


def test_kilosort_neighbourhoods_folder_reaches_the_core(sim_bin, tmp_path):
    missing = tmp_path / "no-such-folder"
    with pytest.raises(spikecube.SpikecubeError) as e:
        spikecube.detect(sim_bin, progress=False, neighbourhoods=missing)
    p = cli("detect", sim_bin, "--out", tmp_path / "o", "--neighbourhoods", missing, check=False)
    assert p.returncode != 0
    assert str(missing) in str(e.value) and str(missing) in p.stderr, (p.stderr, str(e.value))


def test_unknown_setting_lists_valid_names(sim_bin):
    with pytest.raises(ValueError) as e:
        spikecube.detect(sim_bin, progress=False, Th_univresal=8)
    assert "Th_univresal" in str(e.value)
    assert "Th_universal" in str(e.value) and "nearest_chans" in str(e.value)


def test_rust_errors_keep_the_command_line_text(tmp_path):
    f = tmp_path / "x.bin"
    f.write_bytes(b"\0" * 1000)
    with pytest.raises(spikecube.SpikecubeError) as e:
        spikecube.detect(f, progress=False, n_channels=3, fs=30000)
    p = cli("detect", f, "--n-channels", "3", "--fs", "30000", check=False)
    assert p.returncode == 2
    assert p.stderr.strip().endswith(str(e.value)), (p.stderr, str(e.value))


def test_output_folder_and_load(sim_bin, tmp_path):
    out = tmp_path / "spikes"
    calls = []
    r = spikecube.detect(sim_bin, out=out, progress=calls.append)
    assert r.path == out and (out / "spikecube.json").is_file()
    assert calls and calls[-1]["windows_done"] == calls[-1]["windows_total"]
    # The first pass's windows (drift estimate) are reported first, each once.
    first = [c for c in calls if c["first_pass"]]
    assert first and all(c["first_pass"] for c in calls[: len(first)])
    assert [c["windows_done"] for c in first] == list(range(1, len(first) + 1))
    assert not calls[-1]["first_pass"]
    again = spikecube.load(out)
    np.testing.assert_array_equal(again.times, r.times)
    assert again.info["command"] == "detect"


def test_ctrl_c_raises_keyboard_interrupt_and_leaves_nothing(sim_bin, tmp_path):
    out = tmp_path / "interrupted"

    def interrupt(p):
        os.kill(os.getpid(), signal.SIGINT)

    # Python's own SIGINT handler (a process started with SIGINT ignored, e.g.
    # in the background of a non-interactive shell, has none).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            spikecube.detect(sim_bin, out=out, progress=interrupt)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_logs_reach_python_logging(sim_bin, caplog):
    with caplog.at_level(logging.INFO, logger="spikecube"):
        spikecube.detect(sim_bin, progress=False, backend="cpu")
    assert any("detection on cpu" in m for m in caplog.messages), caplog.messages


def test_probe_sources(sim, tmp_path):
    from_file = spikecube.Probe.from_file(sim / "probe.json")
    d = json.loads((sim / "probe.json").read_text())
    from_dict = spikecube.Probe.from_dict(d)
    for a in ("xc", "yc", "kcoords", "chanMap"):
        np.testing.assert_array_equal(getattr(from_file, a), getattr(from_dict, a))
    assert from_file.n_sites == 384
    pi = pytest.importorskip("probeinterface")
    p = pi.Probe(ndim=2, si_units="um")
    p.set_contacts(positions=np.stack([from_file.xc, from_file.yc], 1), shapes="square",
                   shape_params={"width": 12})
    p.set_device_channel_indices(from_file.chanMap)
    from_pi = spikecube.Probe.of(p)
    np.testing.assert_array_equal(from_pi.xc, from_file.xc)
    np.testing.assert_array_equal(from_pi.chanMap, from_file.chanMap)
    with pytest.raises(spikecube.SpikecubeError):
        spikecube.Probe([0, 1], [0.0])  # xc and yc differ in length


def test_preprocess_and_detect_window_equal_command_line(sim_bin, sim, tmp_path):
    pre = spikecube.preprocess(sim_bin, out=tmp_path / "prep", float32=True, progress=False)
    cli("preprocess", sim_bin, "--out", tmp_path / "prep_cli", "--float32", "-q")
    ref = np.fromfile(tmp_path / "prep_cli" / "temp_wh.dat", dtype=np.float32)
    np.testing.assert_array_equal(np.asarray(pre.data).ravel(), ref)
    np.testing.assert_array_equal(pre.whitening_mat, np.load(tmp_path / "prep_cli" / "whitening_mat.npy"))
    # One window of 2 s + 2·61 samples of the whitened data, channels × samples.
    X = np.ascontiguousarray(np.asarray(pre.data[: 60000 + 122]).T)
    np.save(tmp_path / "X.npy", X)
    w = spikecube.detect_window(X, sim / "probe.json")
    cli("detect-window", "--window", tmp_path / "X.npy", "--probe", sim / "probe.json", "--out", tmp_path / "dw")
    assert len(w) > 10
    np.testing.assert_array_equal(w.xy, np.load(tmp_path / "dw" / "xy.npy"))
    np.testing.assert_array_equal(w.amp, np.load(tmp_path / "dw" / "amp.npy"))
    np.testing.assert_array_equal(w.imax, np.load(tmp_path / "dw" / "imax.npy"))
    with pytest.raises(ValueError):
        spikecube.detect_window(X, sim / "probe.json", batch_size=3)  # not a detection setting


def test_peaks_sit_on_the_true_trough(sim_bin, sim):
    r = spikecube.detect(sim_bin, progress=False)
    gt = np.load(sim / "ground_truth.npy")  # trough sample, x, y, amplitude
    d = nearest_offsets(r.peaks["sample_index"], r.positions[:, 1], gt)
    assert d.size > 0.9 * len(r)
    assert np.median(d) == 0


def nearest_offsets(samples, ys, gt, max_dt=20, max_dy=60):
    """sample − true trough for each peak with a true spike within max_dt
    samples and max_dy µm (the nearest in time)."""
    order = np.argsort(gt[:, 0])
    tt, gy = gt[order, 0], gt[order, 2]
    out = []
    for s, y in zip(samples, ys):
        i = np.searchsorted(tt, s)
        best = None
        for k in range(max(0, i - 3), min(len(tt), i + 3)):
            if abs(s - tt[k]) <= max_dt and abs(y - gy[k]) <= max_dy:
                if best is None or abs(s - tt[k]) < abs(s - tt[best]):
                    best = k
        if best is not None:
            out.append(s - tt[best])
    return np.asarray(out)


def _flat_recording(folder, n_ch, seconds, fs=30000.0, seed=0):
    """A flat int16 file of white noise (sd 10) with a Kilosort JSON probe of
    one column at 20 µm; returns (file, probe file)."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((int(seconds * fs), n_ch)) * 10).astype(np.int16)
    f = Path(folder) / f"flat{n_ch}.bin"
    x.tofile(f)
    probe = Path(folder) / f"probe{n_ch}.json"
    probe.write_text(json.dumps({
        "chanMap": list(range(n_ch)), "xc": [0.0] * n_ch, "yc": [20.0 * i for i in range(n_ch)],
        "kcoords": [0] * n_ch, "n_chan": n_ch,
    }))
    return f, probe


@pytest.mark.parametrize("n_ch, seconds, user_file", [
    (8, 2.5, "temp_wh.dat"),  # the file preprocess writes itself
    (32, 1.0, "notes.txt"),   # any other file
])
def test_preprocess_never_touches_a_users_file(tmp_path, n_ch, seconds, user_file):
    rec, probe = _flat_recording(tmp_path, n_ch, seconds)
    out = tmp_path / "prep"
    out.mkdir()
    mine = out / user_file
    mine.write_bytes(b"my own data, not spikecube's")
    kw = dict(n_channels=n_ch, fs=30000.0, out=out, progress=False)
    with pytest.raises(spikecube.SpikecubeError) as e:
        spikecube.preprocess(rec, probe, **kw)
    assert user_file in str(e.value) and "nothing was changed" in str(e.value)
    assert mine.read_bytes() == b"my own data, not spikecube's"
    assert sorted(p.name for p in out.iterdir()) == [user_file]
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]
    # The command line refuses the same folder with the same words.
    p = cli("preprocess", rec, "--probe", probe, "--n-channels", n_ch, "--fs", 30000, "--out", out,
            "-q", check=False)
    # The command line's words; Python adds a line naming its flags in Python.
    said = str(e.value).split("\n(in Python: ")[0]
    assert p.returncode != 0 and p.stderr.strip().endswith(said), (p.stderr, str(e.value))

    # Moved away: Python writes the command line's files, with the same bytes.
    mine.unlink()
    pre = spikecube.preprocess(rec, probe, **kw)
    cli("preprocess", rec, "--probe", probe, "--n-channels", n_ch, "--fs", 30000,
        "--out", tmp_path / "prep_cli", "-q")
    names = sorted(p.name for p in out.iterdir())
    assert names == ["hp_filter.npy", "spikecube.json", "temp_wh.dat", "whitening_mat.npy"]
    assert names == sorted(p.name for p in (tmp_path / "prep_cli").iterdir())
    for name in ["hp_filter.npy", "temp_wh.dat", "whitening_mat.npy"]:
        assert (out / name).read_bytes() == (tmp_path / "prep_cli" / name).read_bytes(), name
    manifest = json.loads((out / "spikecube.json").read_text())
    assert manifest["command"] == "preprocess" and manifest["files"] == names
    assert pre.path == out / "temp_wh.dat" and pre.data.shape == (int(seconds * 30000), n_ch)
    # An earlier result of preprocess is replaced; a file added to it is not.
    spikecube.preprocess(rec, probe, **kw)
    (out / "extra.npy").write_bytes(b"x")
    with pytest.raises(spikecube.SpikecubeError, match="extra.npy"):
        spikecube.preprocess(rec, probe, **kw)
    assert (out / "extra.npy").read_bytes() == b"x"


def test_load_sorting_names_a_detection_folder(sim_cli):
    with pytest.raises(ValueError) as e:
        spikecube.load_sorting(sim_cli)
    assert "`spikecube detect` output folder" in str(e.value)
    assert "spikecube.load(folder)" in str(e.value)
    assert len(spikecube.load(sim_cli)) > 0


def test_errors_give_the_python_names_of_the_flags(tmp_path):
    """A flat binary file without its rate: the command line's message, and
    the Python name of the flag it mentions."""
    rec = tmp_path / "rec.bin"
    np.zeros((100, 4), dtype=np.int16).tofile(rec)
    with pytest.raises(spikecube.SpikecubeError) as e:
        spikecube.detect(rec, n_channels=4, progress=False)
    msg = str(e.value)
    assert "(--fs)" in msg, msg
    assert msg.splitlines()[-1].startswith("(in Python: --fs is fs="), msg
