"""`spikecube.sort` and the SpikeInterface sorter against the command line's
`spikecube sort` on a short 32-site simulation: the same Phy folder, units
that SpikeInterface and the Sorting object both read, Ctrl-C leaving nothing.
"""

import json
import logging
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

import spikecube
from conftest import ROOT, cli

PROBE32 = ROOT / "tests" / "data" / "sort" / "probe32.json"
PHY_ARRAYS = ("spike_times.npy", "spike_clusters.npy", "amplitudes.npy", "templates.npy", "pc_features.npy")


@pytest.fixture(scope="session")
def sim32(tmp_path_factory):
    """A 12-second 32-site simulation (12 units) and its ground truth."""
    d = tmp_path_factory.mktemp("sim32")
    cli("simulate", "--probe", PROBE32, "--seconds", "12", "--n-units", "12", "--rate", "12",
        "--seed", "3", "--out", d / "sim", "-q")
    return d / "sim"


@pytest.fixture(scope="session")
def sim32_bin(sim32):
    return sim32 / "sim_g0_t0.imec0.ap.bin"


@pytest.fixture(scope="session")
def sorted_cli(sim32_bin, tmp_path_factory):
    out = tmp_path_factory.mktemp("sortcli") / "phy"
    cli("sort", sim32_bin, "--backend", "cpu", "--out", out, "-q")
    return out


def same_phy_arrays(a, b):
    for name in PHY_ARRAYS:
        x, y = np.load(Path(a) / name), np.load(Path(b) / name)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert np.array_equal(x, y), name


def test_sort_equals_command_line(sim32_bin, sorted_cli, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="spikecube"):
        s = spikecube.sort(sim32_bin, out=tmp_path / "phy", backend="cpu", progress=False)
    same_phy_arrays(s.path, sorted_cli)
    assert s.path == tmp_path / "phy"
    assert len(s) == np.load(sorted_cli / "spike_times.npy").size > 0
    assert s.spike_times.dtype == np.int64 and s.spike_clusters.dtype == np.int32
    assert set(s.labels) == set(np.unique(s.spike_clusters).tolist())
    assert set(s.labels.values()) <= {"good", "mua"} and s.good_units
    assert s.fs == 30000.0
    # Each stage is logged as it starts.
    for stage in ("detection", "first clustering", "matching", "final clustering"):
        assert any(f"sort: {stage}" in m for m in caplog.messages), caplog.messages
    # Nothing but the Phy folder is left beside it.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["phy"]


def test_sort_settings_by_kilosort_names(sim32_bin, sorted_cli, tmp_path):
    seen = []
    s = spikecube.sort(sim32_bin, out=tmp_path / "phy", backend="cpu", progress=seen.append,
                       Th_learned=9, cluster_init_seed=5, nblocks=1)
    # The drift estimate's first pass is reported as a stage of its own, then the detection pass.
    stages = [p["stage"] for p in seen]
    assert stages[0] == "first pass" and "detection" in stages
    assert stages.index("detection") > max(i for i, s in enumerate(stages) if s == "first pass")
    assert {"first clustering", "matching", "final clustering", "merges and export"} <= {p["stage"] for p in seen}
    assert all(p["windows_done"] <= p["windows_total"] for p in seen)
    # A higher Th_learned keeps fewer learned-template spikes than the default.
    assert 0 < len(s) < np.load(sorted_cli / "spike_times.npy").size
    with pytest.raises(ValueError, match="unknown setting 'Th_learnt'.*Th_learned"):
        spikecube.sort(sim32_bin, out=tmp_path / "x", Th_learnt=9)
    with pytest.raises(ValueError, match="keep_windows_gb"):
        spikecube.sort(sim32_bin, out=tmp_path / "x", keep_windows_gb=-1)
    # The sort's settings are not detect's.
    with pytest.raises(ValueError, match="'max_peels' is not a setting of this call: it belongs to spikecube.sort"):
        spikecube.detect(sim32_bin, max_peels=10)
    assert not (tmp_path / "x").exists()


def test_sort_refuses_an_existing_folder_and_keeps_it(sim32_bin, tmp_path):
    out = tmp_path / "phy"
    out.mkdir()
    (out / "mine.txt").write_text("a user's file")
    with pytest.raises(spikecube.SpikecubeError, match="phy"):
        spikecube.sort(sim32_bin, out=out, backend="cpu", progress=False)
    assert (out / "mine.txt").read_text() == "a user's file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["phy"]


def test_ctrl_c_during_the_sort_leaves_nothing(sim32_bin, tmp_path):
    out = tmp_path / "interrupted"

    def interrupt(p):
        # Past the detection stage: the working folder and its arrays exist.
        if p["stage"] == "matching":
            os.kill(os.getpid(), signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            spikecube.sort(sim32_bin, out=out, backend="cpu", progress=interrupt)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_reaches_the_clustering(sim32_bin, tmp_path, caplog):
    """Ctrl-C in a stage that reads nothing and reports nothing (the
    clustering) stops it there: SIGINT's byte on Python's signal wakeup file
    (as Python's C handler writes it) is seen by spikecube's watch, without
    waiting for the main thread to get back to Python."""
    out = tmp_path / "interrupted"

    def interrupt(p):
        if p["stage"] == "first clustering":
            fd = signal.set_wakeup_fd(-1)
            signal.set_wakeup_fd(fd, warn_on_full_buffer=False)
            assert fd != -1, "no wakeup file during the sort"
            os.write(fd, bytes([signal.SIGINT]))
            # The watch's thread takes the byte before the clustering starts.
            time.sleep(0.2)

    with caplog.at_level(logging.DEBUG, logger="spikecube"):
        with pytest.raises(spikecube.SpikecubeError, match="interrupted"):
            spikecube.sort(sim32_bin, out=out, backend="cpu", progress=interrupt)
    assert any("stopped on request during the clustering" in m for m in caplog.messages), caplog.messages
    assert list(tmp_path.iterdir()) == []
    # The wakeup file is Python's again, and the next sort runs to its end.
    assert signal.set_wakeup_fd(-1) == -1
    r = spikecube.sort(sim32_bin, out=tmp_path / "again", backend="cpu", progress=False)
    assert len(r.labels) > 0


@pytest.fixture(scope="session")
def flat32(sim32_bin, tmp_path_factory):
    """The simulation's 32 sites as a flat int16 file (the sync column dropped),
    and the command line's sort of it."""
    d = tmp_path_factory.mktemp("flat32")
    raw = np.fromfile(sim32_bin, dtype=np.int16).reshape(-1, 33)
    flat = d / "rec.bin"
    np.ascontiguousarray(raw[:, :32]).tofile(flat)
    out = d / "phy"
    cli("sort", flat, "--n-channels", 32, "--fs", 30000, "--probe", PROBE32, "--backend", "cpu",
        "--out", out, "-q")
    return flat, out


def si_recording(flat):
    from probeinterface import Probe as PIProbe
    from spikeinterface.core import read_binary

    p = json.loads(PROBE32.read_text())
    rec = read_binary(flat, sampling_frequency=30000.0, dtype="int16", num_channels=32)
    probe = PIProbe(ndim=2, si_units="um")
    probe.set_contacts(positions=np.c_[p["xc"], p["yc"]], shapes="circle", shape_params={"radius": 6})
    probe.set_device_channel_indices(np.arange(32))
    # In place from SpikeInterface 0.105; a new recording before.
    new = rec.set_probe(probe)
    return rec if new is None else new


def test_spikeinterface_run_sorter(flat32, tmp_path):
    pytest.importorskip("spikeinterface")
    import spikecube.spikeinterface  # noqa: F401  registers the sorter
    from spikeinterface.sorters import available_sorters, get_default_sorter_params, run_sorter

    flat, cli_out = flat32
    assert "spikecube" in available_sorters()
    params = get_default_sorter_params("spikecube")
    assert params["Th_learned"] == 8.0 and params["backend"] == "auto"

    rec = si_recording(flat)
    # A binary file goes to spikecube as it is: the command line's folder.
    sorting = run_sorter("spikecube", rec, folder=tmp_path / "si", backend="cpu", verbose=False)
    same_phy_arrays(tmp_path / "si" / "sorter_output" / "phy", cli_out)
    assert not (tmp_path / "si" / "sorter_output" / "recording.dat").exists()
    cli_clu = np.load(cli_out / "spike_clusters.npy")
    assert sorted(sorting.unit_ids.tolist()) == sorted(np.unique(cli_clu).tolist())
    assert sum(sorting.get_unit_spike_train(u).size for u in sorting.unit_ids) == cli_clu.size

    # A recording that is not one binary file (here a lazy concatenation of
    # it) is written to a binary file first: the same traces, the same sort.
    from spikeinterface.core import concatenate_recordings

    lazy = concatenate_recordings([rec])
    assert not lazy.is_binary_compatible()
    sorting2 = run_sorter("spikecube", lazy, folder=tmp_path / "si2", backend="cpu", verbose=False)
    assert (tmp_path / "si2" / "sorter_output" / "recording.dat").exists()
    same_phy_arrays(tmp_path / "si2" / "sorter_output" / "phy", cli_out)
    assert sorted(sorting2.unit_ids.tolist()) == sorted(sorting.unit_ids.tolist())
    with pytest.raises(Exception, match="Th_learnt"):
        run_sorter("spikecube", rec, folder=tmp_path / "si3", Th_learnt=9, verbose=False)


def test_load_names_a_sort_folder(sorted_cli):
    with pytest.raises(ValueError) as e:
        spikecube.load(sorted_cli)
    assert "`spikecube sort` Phy folder" in str(e.value) and "spikecube.load_sorting(folder)" in str(e.value)


def test_sort_template_drift_and_artifact_settings_are_the_flags(sim32_bin, tmp_path):
    times = tmp_path / "artifacts.csv"
    times.write_text("time_s\n2.0\n7.5\n")
    s = spikecube.sort(sim32_bin, out=tmp_path / "py", backend="cpu", progress=False,
                       templates_from_data=False, drift_smoothing=(1, 1, 1), sig_interp=15, binning_depth=10,
                       artifact_times=times, artifact_window=(1, 3), threads=None)
    cli("sort", sim32_bin, "--backend", "cpu", "--out", tmp_path / "cli", "-q",
        "--templates-from-data", "false", "--drift-smoothing", "1,1,1", "--sig-interp", "15",
        "--binning-depth", "10", "--artifact-times", times, "--artifact-window", "1,3")
    same_phy_arrays(s.path, tmp_path / "cli")
    with pytest.raises(ValueError, match="sig_interp = 'wide': expected a finite number"):
        spikecube.sort(sim32_bin, out=tmp_path / "x", sig_interp="wide")
    assert not (tmp_path / "x").exists()


def test_spikeinterface_sorter_takes_the_new_settings(tmp_path):
    pytest.importorskip("spikeinterface")
    import spikecube.spikeinterface as ssi
    from spikeinterface.sorters import get_default_sorter_params, get_sorter_params_description

    params = get_default_sorter_params("spikecube")
    described = get_sorter_params_description("spikecube")
    for name in ("templates_from_data", "Th_single_ch", "sig_interp", "drift_smoothing", "binning_depth",
                 "artifact_times", "artifact_window", "blank_transients", "templates", "seed",
                 "min_learn_clips", "template_check", "threads"):
        assert params[name] == spikecube.settings()[name], name
        assert described[name] and "spikecube.settings()" not in described[name], name
    # Paths are kept as str (SpikeInterface writes the parameters as JSON);
    # a value of the wrong type is named.
    (tmp_path / "t.txt").write_text("1.5\n")
    (tmp_path / "t.npz").write_bytes(b"")
    checked = ssi.SpikecubeSorter._check_params(None, tmp_path, dict(params, artifact_times=tmp_path / "t.txt",
                                                                      templates=tmp_path / "t.npz"))
    assert checked["artifact_times"] == str(tmp_path / "t.txt") and checked["templates"] == str(tmp_path / "t.npz")
    json.dumps(checked)
    # The times themselves (a list or an array) are kept as a list of floats.
    checked = ssi.SpikecubeSorter._check_params(None, tmp_path, dict(params, artifact_times=np.array([1.5, 3])))
    assert checked["artifact_times"] == [1.5, 3.0]
    json.dumps(checked)
    with pytest.raises(ValueError, match="Th_learned = 'eight': expected a finite number"):
        ssi.SpikecubeSorter._check_params(None, tmp_path, dict(params, Th_learned="eight"))
    # A missing file and a negative budget are refused before the recording is copied.
    with pytest.raises(ValueError, match="artifact_times = .*: no such file"):
        ssi.SpikecubeSorter._check_params(None, tmp_path, dict(params, artifact_times=tmp_path / "none.csv"))
    with pytest.raises(ValueError, match="keep_windows_gb = -3: expected a size in GB"):
        ssi.SpikecubeSorter._check_params(None, tmp_path, dict(params, keep_windows_gb=-3))
