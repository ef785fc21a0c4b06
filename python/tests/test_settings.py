"""The command line's settings of `detect` and `sort` as Python settings: the
same defaults as the flags, the same job as the flags give, values of the
wrong type refused by name before any work, and the worker pool's size."""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import spikecube
from conftest import cli, cli_detect, load_npy
from test_api import _flat_recording, assert_same

# Python setting: the command line's flag.
FLAGS = {
    "templates_from_data": "--templates-from-data",
    "templates": "--templates",
    "Th_single_ch": "--th-single-ch",
    "seed": "--seed",
    "min_learn_clips": "--min-learn-clips",
    "template_check": "--template-check",
    "drift_smoothing": "--drift-smoothing",
    "sig_interp": "--sig-interp",
    "binning_depth": "--binning-depth",
    "drift_mode": "--drift-mode",
    "drift_edge_margin": "--drift-edge-margin",
    "drift_only": "--drift-only",
    "artifact_times": "--artifact-times",
    "artifact_window": "--artifact-window",
    "blank_transients": "--blank-transients",
    "threads": "--threads",
}


def flag_defaults(command):
    """{flag: its `[default: …]` text, or None} of `spikecube COMMAND --help`."""
    text = cli(command, "--help").stdout
    out = {}
    for block in re.split(r"\n(?=\s+--[a-z])", text):
        m = re.match(r"\s+(--[a-z0-9-]+)", block)
        if m:
            d = re.findall(r"^\s*\[default: ([^\]]+)\]", block, flags=re.M)
            out[m.group(1)] = d[0] if d else None
    return out


def as_python(text):
    """A flag's default text as the value Python takes."""
    if text in ("true", "false"):
        return text == "true"
    if text in ("spikecube", "kilosort"):
        return text
    nums = [float(v) for v in re.split(r"[ ,]+", text.strip())]
    return nums[0] if len(nums) == 1 else tuple(nums)


# The sort's settings that `detect` does not have.
SORT_FLAGS = {
    "Th_learned": "--th-learned",
    "max_peels": "--max-peels",
    "duplicate_spike_ms": "--duplicate-spike-ms",
    "acg_threshold": "--acg-threshold",
    "ccg_threshold": "--ccg-threshold",
    "same_template_amplitude_ratio": "--same-template-amplitude-ratio",
    "ks4_swarm_ccg_bug": "--ks4-swarm-ccg-bug",
}


@pytest.mark.parametrize("command", ["detect", "sort"])
def test_defaults_are_the_flags(command):
    defaults = flag_defaults(command)
    ours = spikecube.settings()
    flags = {**FLAGS, **SORT_FLAGS} if command == "sort" else FLAGS
    for name, flag in flags.items():
        assert flag in defaults, (command, flag)
        if defaults[flag] is None:
            # No default on the command line: left out, the same as None (or
            # False for a switch such as --drift-only).
            assert ours[name] in (None, False), name
        else:
            got = ours[name]
            want = as_python(defaults[flag])
            assert (tuple(float(v) for v in got) if isinstance(got, tuple) else got) == want, name


def recorded(folder):
    """The job's template, drift and blanking settings as spikecube.json records them."""
    s = json.loads((Path(folder) / "spikecube.json").read_text())["settings"]
    t = s["templates"]
    return {
        "drift": s["drift"].get("settings"),
        "templates": {k: t.get(k) for k in ("source", "learn_settings", "path")},
        "blanking": s["checks"].get("transients", {}).get("blanking"),
    }


def test_template_drift_and_artifact_settings_are_the_flags(sim_bin, tmp_path):
    times = tmp_path / "artifacts.txt"
    times.write_text("1.0\n2.5\n4.0\n")
    r = spikecube.detect(
        sim_bin, out=tmp_path / "py", progress=False,
        Th_single_ch=7, seed=3, min_learn_clips=50, template_check=False,
        drift_smoothing=(1, 1, 1), sig_interp=15, binning_depth=10,
        artifact_times=times, artifact_window=(1, 3), blank_transients=True,
    )
    folder = cli_detect(
        sim_bin, tmp_path / "cli",
        "--th-single-ch", "7", "--seed", "3", "--min-learn-clips", "50", "--template-check", "false",
        "--drift-smoothing", "1,1,1", "--sig-interp", "15", "--binning-depth", "10",
        "--artifact-times", times, "--artifact-window", "1,3", "--blank-transients", "true",
    )
    assert_same(r, folder)
    got = recorded(r.path)
    assert got == recorded(folder)
    # The values given, not the defaults, reached the job.
    assert got["drift"]["sig_interp"] == 15 and got["drift"]["binning_depth"] == 10
    assert got["drift"]["drift_smoothing"] == [1.0, 1.0, 1.0]
    learn = got["templates"]["learn_settings"]
    assert (learn["Th_single_ch"], learn["seed"], learn["min_clips"], learn["template_check"]) == (7.0, 3, 50, False)
    assert got["blanking"]["events_given"] == 3 and got["blanking"]["around_transients"]
    assert (got["blanking"]["ms_before"], got["blanking"]["ms_after"]) == (1.0, 3.0)
    # The drift's sharp edges and margin, as their flags.
    r = spikecube.detect(sim_bin, out=tmp_path / "py_edges", progress=False, drift_mode="kilosort",
                         drift_edge_margin=np.inf)
    edges = cli_detect(sim_bin, tmp_path / "cli_edges", "--drift-mode", "kilosort",
                        "--drift-edge-margin", "inf")
    assert_same(r, edges)
    assert recorded(r.path)["drift"] == recorded(edges)["drift"]
    assert recorded(edges)["drift"]["mode"] == "kilosort"
    r = spikecube.detect(sim_bin, out=tmp_path / "py_margin", progress=False, drift_edge_margin=40)
    edges = cli_detect(sim_bin, tmp_path / "cli_margin", "--drift-edge-margin", "40")
    assert_same(r, edges)
    assert recorded(r.path)["drift"] == recorded(edges)["drift"]
    # The first pass only: the drift files, and the first pass's spikes.
    r = spikecube.detect(sim_bin, out=tmp_path / "py_only", progress=False, drift_only=True)
    edges = cli_detect(sim_bin, tmp_path / "cli_only", "--drift-only")
    assert_same(r, edges)
    assert (tmp_path / "py_only" / "drift.npy").exists()
    # The times themselves, as a list or an array, blank as the file does.
    for given in ([1.0, 2.5, 4.0], np.array([1.0, 2.5, 4.0])):
        r = spikecube.detect(
            sim_bin, progress=False,
            Th_single_ch=7, seed=3, min_learn_clips=50, template_check=False,
            drift_smoothing=(1, 1, 1), sig_interp=15, binning_depth=10,
            artifact_times=given, artifact_window=(1, 3), blank_transients=True,
        )
        assert_same(r, folder)
        assert r.info["settings"]["checks"]["transients"]["blanking"] == recorded(folder)["blanking"]


def test_templates_file_and_builtin_templates_are_the_flags(sim_bin, sim_cli, sim_cli_keep, tmp_path):
    npz = tmp_path / "templates.npz"
    np.savez(npz, wTEMP=load_npy(sim_cli, "wTEMP.npy"), wPCA=load_npy(sim_cli, "wPCA.npy"))
    r = spikecube.detect(sim_bin, out=tmp_path / "py", progress=False, templates=npz)
    folder = cli_detect(sim_bin, tmp_path / "cli", "--templates", npz)
    assert_same(r, folder)
    assert recorded(r.path)["templates"] == recorded(folder)["templates"]
    assert recorded(r.path)["templates"]["source"] == "file"

    # templates_from_data=False: Kilosort4's built-in templates.
    r = spikecube.detect(sim_bin, progress=False, templates_from_data=False, keep_boundary_duplicates=True, nblocks=0)
    assert_same(r, sim_cli_keep)
    assert r.info["settings"]["templates"]["source"] == "builtin"

    # Both sources at once: refused, with the command line's words.
    with pytest.raises(spikecube.SpikecubeError) as e:
        spikecube.detect(sim_bin, progress=False, templates=str(npz), templates_from_data=True)
    p = cli("detect", sim_bin, "--out", tmp_path / "x", "--templates", npz, "--templates-from-data", "true",
            check=False)
    # The command line's words; Python adds a line naming its flags in Python.
    said = str(e.value).split("\n(in Python: ")[0]
    assert p.returncode != 0 and p.stderr.strip().endswith(said), (p.stderr, str(e.value))
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("name, value, expected", [
    ("Th_learned", "eight", "Th_learned = 'eight': expected a finite number"),
    ("nblocks", 1.5, "nblocks = 1.5: expected a whole number"),
    ("nearest_chans", -2, "nearest_chans = -2: expected a whole number from 0 to 2**64 - 1"),
    ("seed", 2**70, f"seed = {2**70}: expected a whole number from 0 to 2**64 - 1"),
    ("do_CAR", "yes", "do_CAR = 'yes': expected True or False"),
    ("templates", 3, "templates = 3: expected a path"),
    ("artifact_times", ["a.txt"], "artifact_times: time 1 of 1 is 'a.txt'; every time must be a finite number"),
    ("artifact_times", [1.0, float("nan")], "artifact_times: time 2 of 2 is nan; every time must be a finite "
                                             "number of seconds"),
    ("artifact_times", ["2.5"], "artifact_times: time 1 of 1 is '2.5'; every time must be"),
    ("artifact_times", [], "artifact_times: no times given"),
    ("artifact_times", [[1.0, 2.0], [3.0, 4.0]], "artifact_times = [[1.0, 2.0], [3.0, 4.0]]: expected one row or "
                                                  "column of times in seconds, got an array of shape (2, 2)"),
    ("drift_smoothing", 0.5, "drift_smoothing = 0.5: expected three numbers"),
    ("artifact_window", (1, "x"), "artifact_window = (1, 'x'): expected two numbers"),
    ("exclude_channels", "3,4", "exclude_channels = '3,4': expected a list of channel numbers"),
    ("cluster_init_generator", "mt", "cluster_init_generator = 'mt': expected 'torch' or 'chacha8'"),
    ("drift_mode", "ks4", "drift_mode = 'ks4': expected 'spikecube' or 'kilosort'"),
    ("drift_edge_margin", -5, "drift_edge_margin = -5: expected a number of µm, 0 or more"),
    ("threads", "4", "threads = '4': expected a whole number"),
    ("threads", 0, "threads = 0: expected a whole number of threads, 1 or more"),
])
def test_a_wrong_type_is_named_before_any_work(tmp_path, name, value, expected):
    missing = tmp_path / "no-such-recording.bin"  # never opened: the check comes first
    with pytest.raises(ValueError) as e:
        spikecube.sort(missing, out=tmp_path / "out", progress=False, **{name: value})
    assert str(e.value).startswith(expected), str(e.value)
    assert not isinstance(e.value, spikecube.SpikecubeError)
    if name not in ("Th_learned", "cluster_init_generator"):  # detect has no sort settings
        with pytest.raises(ValueError, match=re.escape(expected)):
            spikecube.detect(missing, out=tmp_path / "out", progress=False, **{name: value})
    assert list(tmp_path.iterdir()) == []


def test_values_are_made_plain():
    from spikecube import _settings

    g = _settings.split(dict(nblocks=np.int64(2), Th_learned=np.float32(9), tmax=np.inf, batch_size=40000.0,
                             templates=Path("t.npz"), exclude_channels=np.array([3, 4]), do_CAR=np.bool_(False)))
    assert g["drift"]["nblocks"] == 2 and type(g["drift"]["nblocks"]) is int
    assert type(g["sort"]["Th_learned"]) is float and g["recording"]["tmax"] == np.inf
    assert g["preprocessing"]["batch_size"] == 40000 and type(g["preprocessing"]["batch_size"]) is int
    assert g["templates"]["templates"] == "t.npz" and g["recording"]["exclude_channels"] == (3, 4)
    assert g["preprocessing"]["do_CAR"] is False
    json.dumps(g)  # what goes to the core


THREADS = """
import sys, spikecube
rec, probe = sys.argv[1], sys.argv[2]
kw = dict(n_channels=8, fs=30000.0, progress=False, backend="cpu", templates_from_data=False, nblocks=0)
r = spikecube.detect(rec, probe, threads=1, **kw)
print("device:", r.info["provenance"]["device"])
spikecube.detect(rec, probe, threads=1, **kw)  # the same count again
for n in (2, 0):
    try:
        spikecube.detect(rec, probe, threads=n, **kw)
    except ValueError as e:
        print("refused:", e)
"""


def test_threads_sizes_the_pool_once_per_process(tmp_path):
    rec, probe = _flat_recording(tmp_path, 8, 2.5)
    p = subprocess.run([sys.executable, "-c", THREADS, str(rec), str(probe)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == "device: CPU, 1 thread", p.stdout
    assert lines[1].startswith("refused: threads = 2:") and "with 1 thread," in lines[1], p.stdout
    assert lines[2].startswith("refused: threads = 0:"), p.stdout

