"""Shared helpers: the `spikecube` program (for the command line's results to
compare with) and simulated recordings.

`SPIKECUBE_BIN` names the program; default: target/release/spikecube of this
checkout (`cargo build --release`).
"""

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = os.environ.get("SPIKECUBE_BIN", str(ROOT / "target" / "release" / "spikecube"))


def cli(*args, check=True):
    assert Path(BIN).is_file(), f"spikecube program not found at {BIN}; run cargo build --release"
    return subprocess.run([BIN, *map(str, args)], check=check, capture_output=True, text=True)


def cli_detect(rec, out, *flags):
    """`spikecube detect REC --out OUT FLAGS...`; returns OUT."""
    cli("detect", *([rec] if not isinstance(rec, list) else rec), "--out", out, "-q", *flags)
    return Path(out)


@pytest.fixture(scope="session")
def sim(tmp_path_factory):
    """A 7-second simulated 384-channel SpikeGLX recording (4 windows, the last
    one short) with its ground truth."""
    d = tmp_path_factory.mktemp("sim")
    cli("simulate", "--seconds", "7", "--out", d / "sim")
    return d / "sim"


@pytest.fixture(scope="session")
def sim_bin(sim):
    return sim / "sim_g0_t0.imec0.ap.bin"


@pytest.fixture(scope="session")
def sim_cli(sim_bin, tmp_path_factory):
    """The command line's result on the simulated recording (default settings)."""
    return cli_detect(sim_bin, tmp_path_factory.mktemp("cli") / "out")


@pytest.fixture(scope="session")
def sim_cli_keep(sim_bin, tmp_path_factory):
    """The command line's result as the chunked SpikeInterface node computes it:
    --keep-boundary-duplicates, built-in templates, one pass (no drift correction)."""
    return cli_detect(sim_bin, tmp_path_factory.mktemp("clik") / "out", "--keep-boundary-duplicates",
                      "--templates-from-data", "false", "--nblocks", "0")


def load_npy(folder, name):
    return np.load(Path(folder) / name)
