"""The shipped job-engine recipes on three simulated recordings: a Slurm array
(contrib/slurm) and Snakemake's local mode (contrib/snakemake). Each task's
output must be byte-identical to a plain `spikecube detect` of the same
recording (every file but spikecube.json, which holds timings and provenance).
"""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import (
    BIN, CONTRIB, FLAGS, NAMES, assert_same_outputs, cli, job_info, need, plan,
    provenance, require_slurm, run_cmd, wait_jobs,
)


def summary(run):
    lines = (Path(run) / "summary.tsv").read_text().splitlines()
    head = lines[0].split("\t")
    return [dict(zip(head, l.split("\t"))) for l in lines[1:]]


def requeue(job, env):
    """`scontrol requeue JOB`, then made eligible now: Slurm holds a requeued
    job for about two minutes before it may start again.

    slurmd revokes a job's credential when the job is killed or ends, and
    refuses to launch it again ("Job credential revoked", the task ends
    FAILED) while the new start time is not later than the revocation, to the
    second. A requeue within the second of the kill or end would hit that, so
    it waits two seconds first (a person typing the command never does)."""
    time.sleep(2)
    run_cmd(["scontrol", "requeue", job], env)
    run_cmd(["scontrol", "update", f"jobid={job}", "StartTime=now"], env)


def wait_restarted(job, task, restarts, env, timeout=120):
    """Waits until array task `job` (index `task`) has been restarted
    `restarts` times and has ended again; returns its final state."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        info = job_info(job, env)[task]
        if int(info["Restarts"]) >= restarts and info["JobState"] in ("COMPLETED", "FAILED", "CANCELLED"):
            if info["JobState"] != "COMPLETED":
                print(f"{job} ended {info['JobState']}: Reason={info.get('Reason')} ExitCode={info.get('ExitCode')}")
            return info["JobState"]
        time.sleep(0.5)
    raise AssertionError(f"{job} not restarted {restarts} times and ended after {timeout} s: {info}")


def test_array_equals_plain_detect_and_collect_runs_after_it(slurm_found, recordings, reference, tmp_path):
    slurm = require_slurm(slurm_found)
    run = plan(tmp_path / "run", recordings)
    out = run_cmd([CONTRIB / "slurm" / "submit", run], slurm).stdout.split()
    # "array <id> (3 tasks, logs in …) collect <id>"
    array, collect = out[1], out[out.index("collect") + 1]
    wait_jobs([array, collect], slurm)
    tasks = job_info(array, slurm)
    assert sorted(tasks) == ["0", "1", "2"], tasks.keys()
    for t, info in tasks.items():
        assert info["JobState"] == "COMPLETED", (t, info["JobState"], (run / "logs" / f"{t}.log").read_text())
    coll = job_info(collect, slurm)[""]
    assert coll["JobState"] == "COMPLETED", (run / "logs" / "collect.log").read_text()
    last_end = max(info["EndTime"] for info in tasks.values())
    assert coll["StartTime"] >= last_end, (coll["StartTime"], last_end)

    assert_same_outputs(run, reference)
    seen = set()
    for i, name in enumerate(NAMES):
        p = provenance(run, name)
        env = p["env"]
        assert env["SLURM_ARRAY_JOB_ID"] == array and env["SLURM_ARRAY_TASK_ID"] == str(i), env
        assert env["SLURM_JOB_ID"], env
        assert p["host"] and p["device"].startswith("CPU"), p
        assert p["batch"]["index"] == i and p["batch"]["name"] == name, p
        seen.add(env["CUDA_VISIBLE_DEVICES"])
    # Two GPUs, three tasks, two at a time: both GPUs were handed out.
    assert seen == {"0", "1"}, seen
    rows = summary(run)
    assert [r["status"] for r in rows] == ["ok"] * 3, rows
    assert all(r["job"].startswith(f"{array}_") and int(r["spikes"]) > 0 for r in rows), rows


def test_cancelled_and_requeued_task_gives_the_same_bytes(slurm_found, recordings, reference, tmp_path):
    slurm = require_slurm(slurm_found)
    run = plan(tmp_path / "run", recordings)
    env = dict(slurm, RAYON_NUM_THREADS="1")
    r = run_cmd(["sbatch", "--parsable", "--array=0-2", f"--output={run}/logs/%a.log",
                 CONTRIB / "slurm" / "spikecube-array.sbatch", run], env)
    array = r.stdout.strip().split(";")[0]
    # Cancel task 1 while its output is being written (its staged folder exists).
    out = run / "out"
    t0 = time.time()
    while not list(out.glob(f"{NAMES[1]}.partial-*")):
        assert time.time() - t0 < 120, "task 1 never started writing"
        time.sleep(0.02)
    run_cmd(["scancel", f"{array}_1"], env)
    t0 = time.time()
    while job_info(f"{array}_1", env)["1"]["JobState"] not in ("CANCELLED", "COMPLETED", "FAILED"):
        assert time.time() - t0 < 60
        time.sleep(0.2)
    state = job_info(f"{array}_1", env)["1"]["JobState"]
    assert state == "CANCELLED", f"task 1 ended {state} before it could be cancelled"
    assert not (out / NAMES[1]).exists(), "a cancelled task left an output"
    requeue(f"{array}_1", env)
    assert wait_restarted(f"{array}_1", "1", 1, env) == "COMPLETED"
    wait_jobs([array], env)
    for t, info in job_info(array, env).items():
        assert info["JobState"] == "COMPLETED", (t, info["JobState"])
    log = (run / "logs" / "1.log").read_text()
    assert "interrupted (SIGTERM)" in log, log
    assert_same_outputs(run, reference)
    assert not list(out.glob("*.partial-*")), list(out.iterdir())
    assert provenance(run, NAMES[1])["env"]["SLURM_RESTART_COUNT"] == "1"
    # Requeued again once complete: skipped, nothing rewritten.
    before = (out / NAMES[1] / "spikecube.json").stat().st_mtime_ns
    requeue(f"{array}_1", env)
    assert wait_restarted(f"{array}_1", "1", 2, env) == "COMPLETED"
    log = (run / "logs" / "1.log").read_text()
    assert "skipped" in log.splitlines()[-1], log[-2000:]
    assert (out / NAMES[1] / "spikecube.json").stat().st_mtime_ns == before


def test_missing_or_half_written_outputs_make_collect_fail(recordings, reference, tmp_path):
    run = plan(tmp_path / "run", recordings)
    for i in range(3):
        cli("batch", "task", run, "--index", i, "-q")
    assert cli("batch", "collect", run).returncode == 0
    out = run / "out"
    # Half-written: a file cut short; missing: a folder gone (a killed run's
    # staged folder left beside it).
    pos = out / NAMES[0] / "spike_positions.npy"
    pos.write_bytes(pos.read_bytes()[:-5])
    shutil.rmtree(out / NAMES[2])
    (out / f"{NAMES[2]}.partial-999999").mkdir()
    r = cli("batch", "collect", run, check=False)
    assert r.returncode != 0
    assert f"task 0 ({NAMES[0]}) incomplete" in r.stderr and "spike_positions.npy is" in r.stderr, r.stderr
    assert f"task 2 ({NAMES[2]}) missing" in r.stderr, r.stderr
    assert "2 of 3 tasks are not done" in r.stderr, r.stderr
    assert [row["status"] for row in summary(run)] == ["incomplete", "ok", "missing"]
    # Running the two tasks again mends the run; the complete one is skipped.
    assert "skipped" in cli("batch", "task", run, "--index", 1).stdout
    for i in (0, 2):
        r = cli("batch", "task", run, "--index", i, "-q")
        assert "skipped" not in r.stdout
    assert cli("batch", "collect", run).returncode == 0
    assert_same_outputs(run, reference)
    assert not (out / f"{NAMES[2]}.partial-999999").exists()


def test_snakemake_local_equals_plain_detect(recordings, reference, tmp_path):
    snakemake = shutil.which("snakemake") or str(Path(sys.executable).parent / "snakemake")
    if not Path(snakemake).exists():
        need("Snakemake", "pip install -r tests/slurm/requirements.txt")
    run = plan(tmp_path / "run", recordings)
    r = subprocess.run(
        [snakemake, "-s", str(CONTRIB / "snakemake" / "Snakefile"), "--config", f"run={run}",
         f"spikecube={Path(BIN).resolve()}", "--cores", "2", "--resources", "gpu=2", "--quiet"],
        capture_output=True, text=True, cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert_same_outputs(run, reference)
    assert [row["status"] for row in summary(run)] == ["ok"] * 3
    assert sorted(p.name for p in (run / "snakemake").iterdir()) == ["0.done", "1.done", "2.done"]
