"""SpikeInterface (through neo and probeinterface) reads what `spikecube simulate`
writes: the same channel count, sample rate, gain and site positions as the
`probe.json` written beside the recording.

Run by .ci/run with `SPIKECUBE_BIN` naming the built program; by hand:
    pip install -r tests/python/requirements.txt
    cargo build --release && pytest tests/python
"""

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import spikeinterface.extractors as se

ROOT = Path(__file__).resolve().parents[2]
BIN = os.environ.get("SPIKECUBE_BIN", str(ROOT / "target" / "release" / "spikecube"))


def simulate(out: Path, probe: Path | None = None) -> Path:
    assert Path(BIN).is_file(), f"spikecube program not found at {BIN}; run cargo build --release"
    cmd = [BIN, "simulate", "--seconds", "1", "--n-units", "4", "--out", str(out)]
    if probe is not None:
        cmd += ["--probe", str(probe)]
    subprocess.run(cmd, check=True, capture_output=True)
    return out


def expected_locations(folder: Path) -> np.ndarray:
    """Site positions of probe.json, in file-column (channel) order."""
    p = json.loads((folder / "probe.json").read_text())
    locs = np.full((max(p["chanMap"]) + 1, 2), np.nan)
    for c, x, y in zip(p["chanMap"], p["xc"], p["yc"]):
        locs[c] = (x, y)
    return locs


def check(folder: Path, gain_uv: float) -> None:
    rec = se.read_spikeglx(folder, stream_id="imec0.ap")
    assert rec.get_num_channels() == 384
    assert rec.get_sampling_frequency() == 30000.0
    assert rec.get_num_samples() == 30000
    np.testing.assert_allclose(rec.get_channel_gains(), gain_uv, rtol=1e-6)
    np.testing.assert_allclose(rec.get_channel_locations(), expected_locations(folder), atol=1e-3)
    # The samples are the file's.
    raw = np.memmap(folder / "sim_g0_t0.imec0.ap.bin", dtype="<i2", mode="r").reshape(-1, 385)
    np.testing.assert_array_equal(rec.get_traces(start_frame=0, end_frame=100), raw[:100, :384])


def test_default_probe_reads_as_np2(tmp_path):
    folder = simulate(tmp_path / "np2")
    meta = (folder / "sim_g0_t0.imec0.ap.meta").read_text()
    assert "imDatPrb_pn=NP2003" in meta
    # 0.62 V / 2048 / gain 100, in µV.
    check(folder, 0.62 / 2048 / 100 * 1e6)


def test_np1_layout_reads_as_np1(tmp_path):
    # Neuropixels 1.0 electrodes 0..383 (bank 0) as probeinterface places them:
    # staggered rows 20 µm apart, x = 16 or 0 (alternate rows) + 32 (second column).
    e = np.arange(384)
    row = e // 2
    xc = np.where(row % 2 == 0, 16.0, 0.0) + 32.0 * (e % 2)
    yc = 20.0 * row
    probe = tmp_path / "np1.json"
    probe.write_text(json.dumps({
        "chanMap": e.tolist(), "xc": xc.tolist(), "yc": yc.tolist(),
        "kcoords": [0] * 384, "n_chan": 385,
    }))
    folder = simulate(tmp_path / "np1", probe)
    meta = (folder / "sim_g0_t0.imec0.ap.meta").read_text()
    assert "imDatPrb_type=0" in meta
    # 0.6 V / 512 / gain 500, in µV.
    check(folder, 0.6 / 512 / 500 * 1e6)
