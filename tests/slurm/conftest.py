"""Shared helpers for the job-engine recipes (contrib/slurm, contrib/snakemake):
the `spikecube` program, three small simulated recordings, their plain
`spikecube detect` outputs, and a running single-node Slurm.

`SPIKECUBE_BIN` names the program (default: target/release/spikecube of this
checkout). Slurm is the one `SLURM_CONF` points at (`.ci/slurm up DIR` starts
one on 127.0.0.1 with two fake GPUs). With CI=true, a missing Slurm or
Snakemake fails the tests that need it; elsewhere they are skipped, saying why.
"""

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = os.environ.get("SPIKECUBE_BIN", str(ROOT / "target" / "release" / "spikecube"))
CONTRIB = ROOT / "contrib"
IN_CI = os.environ.get("CI", "").lower() == "true"
# Every task's flags (and the plain runs'): the CPU back end, as in CI.
FLAGS = ["--backend", "cpu"]
NAMES = ["rec0_sim_g0_t0.imec0.ap", "rec1_sim_g0_t0.imec0.ap", "rec2_sim_g0_t0.imec0.ap"]


def need(what, why):
    """Fail under CI, skip elsewhere, naming what is missing."""
    if IN_CI:
        pytest.fail(f"{what} is needed in CI (CI=true): {why}")
    pytest.skip(f"{what} not available: {why}")


def cli(*args, check=True, env=None):
    assert Path(BIN).is_file(), f"spikecube program not found at {BIN}; run cargo build --release"
    r = subprocess.run([BIN, *map(str, args)], capture_output=True, text=True, env=env)
    if check and r.returncode != 0:
        raise AssertionError(f"spikecube {' '.join(map(str, args))}: exit {r.returncode}\n{r.stderr}")
    return r


def files_of(folder):
    """Every file's bytes except spikecube.json (which holds timings and provenance)."""
    folder = Path(folder)
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != "spikecube.json"}


def assert_same_outputs(run, reference):
    for name in NAMES:
        got, want = files_of(Path(run) / "out" / name), files_of(Path(reference) / name)
        assert sorted(got) == sorted(want), f"{name}: files {sorted(got)} != {sorted(want)}"
        for f in want:
            assert got[f] == want[f], f"{name}/{f} differs from plain `spikecube detect`"


def provenance(run, name):
    return json.loads((Path(run) / "out" / name / "spikecube.json").read_text())["provenance"]


@pytest.fixture(scope="session")
def recordings(tmp_path_factory):
    """Three 3-s 32-site simulated recordings (different seeds), and the probe."""
    d = tmp_path_factory.mktemp("recordings")
    probe = d / "probe32.json"
    probe.write_text(json.dumps({
        "chanMap": list(range(32)),
        "xc": [32.0 * (i % 2) for i in range(32)],
        "yc": [20.0 * (i // 2) for i in range(32)],
        "kcoords": [0] * 32,
        "n_chan": 32,
    }))
    recs = []
    for i in range(3):
        out = d / f"rec{i}"
        cli("simulate", "-q", "--probe", probe, "--seconds", "3", "--n-units", "6",
            "--seed", i, "--out", out)
        recs.append(out / "sim_g0_t0.imec0.ap.bin")
    return recs, probe


@pytest.fixture(scope="session")
def reference(recordings, tmp_path_factory):
    """Plain `spikecube detect` of each recording, named as the tasks name them."""
    recs, probe = recordings
    d = tmp_path_factory.mktemp("reference")
    for rec, name in zip(recs, NAMES):
        cli("detect", "-q", rec.resolve(), "--out", d / name, "--probe", probe.resolve(), *FLAGS)
    return d


def plan(run, recordings):
    recs, probe = recordings
    r = cli("batch", "plan", *recs, "--out", run, "--probe", probe, *FLAGS)
    assert (Path(run) / "manifest.tsv").is_file(), r.stderr
    return run


def _slurm_env():
    """The environment for Slurm's commands, or why there is no Slurm."""
    if shutil.which("sbatch") is None:
        return "Slurm (sbatch)", "install Debian's slurm-wlm and munge and start one with .ci/slurm up DIR"
    if not os.environ.get("SLURM_CONF"):
        return "A running Slurm", "SLURM_CONF is not set (.ci/slurm up DIR prints the line to export)"
    r = subprocess.run(["sinfo", "-h", "-N", "-o", "%t %G"], capture_output=True, text=True)
    if r.returncode != 0 or "gpu:2" not in r.stdout:
        return "A Slurm node with two GPUs", f"sinfo says: {r.stdout.strip()} {r.stderr.strip()}"
    env = dict(os.environ)
    env["SPIKECUBE"] = str(Path(BIN).resolve())
    return env


@pytest.fixture(scope="session")
def slurm_found():
    """[`_slurm_env`], looked up once; tests call `require_slurm` on it."""
    return _slurm_env()


def require_slurm(found):
    """The environment for Slurm's commands. Without a Slurm the test fails
    (CI=true) or is skipped: called in the test's body, so that it counts as a
    failed test (a failing fixture would count as an error)."""
    if isinstance(found, tuple):
        need(*found)
    return found


def run_cmd(args, env, check=True):
    r = subprocess.run(list(map(str, args)), capture_output=True, text=True, env=env)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, args))}: exit {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


def job_info(job, env):
    """`scontrol show job JOB` as {task id or '': {key: value}} (one entry per array task)."""
    r = run_cmd(["scontrol", "-o", "show", "job", job], env)
    out = {}
    for line in r.stdout.splitlines():
        kv = dict(f.split("=", 1) for f in line.split() if "=" in f)
        out[kv.get("ArrayTaskId", "")] = kv
    return out


def wait_jobs(jobs, env, timeout=180):
    """Waits until none of `jobs` is pending or running (squeue lists none)."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        r = run_cmd(["squeue", "-h", "-j", ",".join(map(str, jobs)), "-o", "%i %T"], env, check=False)
        if r.returncode == 0 and not r.stdout.strip():
            return
        time.sleep(0.5)
    raise AssertionError(f"jobs {jobs} still queued after {timeout} s: {r.stdout}")
