"""Real consumers open the sort's Phy folder as spikecube writes it.

`spikecube export-phy` (a hidden subcommand) runs the CCG-gated merges and the
Phy export on Kilosort4's own final clustering (tests/data/sort/<case>/). Then:
- phylib's TemplateModel (Phy's own loader) opens the folder through params.py,
  reads spike waveforms from the raw file it names, the PC features and the
  templates;
- SpikeInterface's read_kilosort loads the units and their spike trains.

The fixture's raw recording is not in the repository: a file of the same
shape (n_channels_dat int16 columns, long enough for every spike) with a known
pattern stands in for it, so the waveforms phylib reads can be checked sample
for sample.

Run by .ci/run with `SPIKECUBE_BIN` naming the built program; by hand:
    pip install -r tests/python/requirements.txt
    cargo build --release && pytest tests/python
"""

import ast
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = os.environ.get("SPIKECUBE_BIN", str(ROOT / "target" / "release" / "spikecube"))
SORT = ROOT / "tests" / "data" / "sort"


def cases():
    found = sorted(p for p in SORT.glob("*") if (p / "final_out.npz").is_file())
    assert found, f"no Kilosort4 sort fixture under {SORT}"
    return found


def probe_of(case: Path) -> Path:
    """The probe each case was sorted with (tests/data/sort/README.md)."""
    if case.name == "oe16":
        return ROOT / "data" / "probes" / "openephys_16ch_linear.json"
    return SORT / "probe32.json"


def pattern(n_samples: int, n_chan: int) -> np.ndarray:
    """A raw int16 recording whose every sample says where it is."""
    t = np.arange(n_samples, dtype=np.int64)[:, None]
    c = np.arange(n_chan, dtype=np.int64)[None, :]
    return ((t * 7 + c * 1000) % 30011 - 15000).astype("<i2")


@pytest.fixture(scope="module", params=cases(), ids=lambda p: p.name)
def folder(request, tmp_path_factory):
    case = request.param
    assert Path(BIN).is_file(), f"spikecube program not found at {BIN}; run cargo build --release"
    tmp = tmp_path_factory.mktemp(case.name)
    # params.py's channel count, from a first export.
    first = tmp / "first"
    subprocess.run([BIN, "export-phy", "--from-npz", str(case), "--probe", str(probe_of(case)),
                    "--out", str(first)], check=True, capture_output=True)
    params = {}
    for line in (first / "params.py").read_text().splitlines():
        k, v = line.split(" = ", 1)
        params[k] = ast.literal_eval(v)
    n_chan = params["n_channels_dat"]
    n_samples = int(np.load(first / "spike_times.npy").max()) + 200
    raw = tmp / "raw.bin"
    pattern(n_samples, n_chan).tofile(raw)
    out = tmp / "phy"
    r = subprocess.run([BIN, "export-phy", "--from-npz", str(case), "--probe", str(probe_of(case)),
                        "--out", str(out), "--dat-path", str(raw)], check=True, capture_output=True,
                       text=True)
    assert "units" in r.stdout
    return out, raw, n_chan, n_samples


def test_phylib_template_model(folder):
    from phylib.io.model import load_model

    out, raw, n_chan, n_samples = folder
    model = load_model(out / "params.py")
    try:
        st = np.load(out / "spike_times.npy")
        clu = np.load(out / "spike_clusters.npy")
        templates = np.load(out / "templates.npy")
        assert model.n_spikes == len(st)
        assert model.n_templates == templates.shape[0]
        assert model.n_channels == np.load(out / "channel_map.npy").shape[0]
        np.testing.assert_array_equal(model.spike_samples, st)
        np.testing.assert_array_equal(model.spike_clusters, clu)
        assert model.traces is not None, "phylib did not open the raw file params.py names"
        assert model.traces.shape[0] == n_samples

        # Waveforms from the raw file: phylib's window around each spike, at the channel map's columns.
        ids = np.unique(np.linspace(0, len(st) - 1, 20).astype(np.int64))
        chans = np.arange(min(4, model.n_channels))
        w = model.get_waveforms(ids, chans)
        nsw = model.n_samples_waveforms
        assert w.shape == (len(ids), nsw, len(chans))
        full = pattern(n_samples, n_chan)
        cmap = np.load(out / "channel_map.npy")
        for i, s in enumerate(ids):
            t0 = st[s] - nsw // 2
            if t0 >= 0 and t0 + nsw <= n_samples:
                np.testing.assert_array_equal(w[i], full[t0:t0 + nsw][:, cmap[chans]])

        # PC features: phylib reads pc_features on the unit's pc_feature_ind sites.
        pcs = np.load(out / "pc_features.npy")
        ind = np.load(out / "pc_feature_ind.npy")
        assert pcs.dtype == np.float32 and ind.dtype == np.uint32
        u = int(clu[ids[0]])
        f = model.get_features(ids[:1], ind[u])
        np.testing.assert_allclose(f[0], pcs[ids[0]].T, rtol=0, atol=0)

        # Templates (whitened, as Kilosort4's): the unit's largest channel is its peak.
        t = model.get_template(u)
        assert t is not None and t.template.shape[0] == templates.shape[1]
        assert np.all(np.isfinite(t.template))
    finally:
        model.close()


def test_spikeinterface_read_kilosort(folder):
    import spikeinterface.extractors as se

    out, _, _, _ = folder
    sorting = se.read_kilosort(out)
    st = np.load(out / "spike_times.npy")
    clu = np.load(out / "spike_clusters.npy")
    labels = (out / "cluster_KSLabel.tsv").read_text().splitlines()[1:]
    assert sorted(sorting.unit_ids) == sorted(np.unique(clu))
    assert len(labels) == len(np.unique(clu))
    for u in sorting.unit_ids[:10]:
        np.testing.assert_array_equal(sorting.get_unit_spike_train(u), st[clu == u])
    ks = sorting.get_property("KSLabel")
    assert set(ks) <= {"good", "mua"}
    good = se.read_kilosort(out, keep_good_only=True)
    assert good.get_num_units() == sum(1 for l in labels if l.endswith("good"))
