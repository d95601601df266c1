"""Issue 40's acceptance scenario in one sweep, on the one-node SLURM of scripts/slurm_up.sh (root):

a 5-run nano sweep under QOS normlab-limited (3 jobs may wait or run), one-minute time limits (each run
needs two or more job lives), the coordinator killed (-9) twice mid-sweep and rerun, one job scancel-ed by
hand, a third coordinator killed the moment sbatch accepts its array (before it stores the ids); rerun until
no run is left. Checks: every run `ok`, its row's job and worker the same job, sacct says COMPLETED for it;
every run lived in two or more jobs (its row's attempts); no run was trained by two jobs alive at once
(sacct's Start and End of the jobs whose logs name it); no duplicate job (every job of the sweep in sacct is
a row's job, the scancel-ed one, or one that ended on a limit and was replaced); no row was ever `failed`
but a cancelled job's.

    PYTHONPATH=src python scripts/slurm_judge.py [WORKDIR]    # exit 0: all held; 1: what broke
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO / "src"), "NORMLAB_SLURM_POLL_S": "2", "OMP_NUM_THREADS": "1"}


def rows(out: Path) -> list[dict]:
    try:
        with sqlite3.connect(out / "sweep.db", timeout=30) as con:
            con.row_factory = sqlite3.Row
            return [dict(r) for r in con.execute("select run_id, status, job, worker, reason, attempts from runs")]
    except sqlite3.OperationalError:
        return []


def sacct(name: str, fields: str = "JobID,State") -> dict[str, str]:
    text = subprocess.run(
        ["sacct", "-n", "-X", "-P", "--name", name, "-S", "now-3hours", "-o", fields],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return dict(line.split("|", 1) for line in text.splitlines() if line.strip())


def overlapping(out: Path, name: str) -> list[str]:
    """Runs trained by two jobs alive at once: which job ran which run from the jobs' logs ("normlab: RUN in job
    J"), each job's life from sacct's Start and End."""
    import re

    ran: dict[str, set[str]] = {}
    for log in (out / "logs" / "jobs").rglob("*_log.out"):
        for run_id, job in re.findall(r"normlab: (\S+) in job (\S+):", log.read_text()):
            ran.setdefault(run_id, set()).add(job)
    life = {j: v.split("|") for j, v in sacct(name, "JobID,Start,End").items()}
    found = []
    for run_id, jobs in ran.items():
        spans = sorted((life[j][0], life[j][1], j) for j in jobs if j in life)
        for (s1, e1, j1), (s2, _, j2) in zip(spans, spans[1:]):
            if s2 < e1:
                found.append(f"{run_id}: jobs {j1} ({s1} to {e1}) and {j2} (from {s2}) alive at once")
    return found


def wait(what: str, check, timeout: float = 600):
    end = time.time() + timeout
    while time.time() < end:
        got = check()
        if got:
            return got
        time.sleep(1)
    raise SystemExit(f"judge: timed out waiting for {what}")


def main() -> int:
    sys.path.insert(0, str(REPO / "src"))
    sys.path.insert(0, str(REPO))
    from normlab.experiments import SweepConfig
    from normlab.experiments.runner import _to_toml
    from tests.conftest import SENTENCES

    work = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="slurm-judge-"))
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / "corpus.txt"
    corpus.write_text("\n".join(SENTENCES[(i * 7) % len(SENTENCES)] for i in range(800)))
    name = f"judge-{uuid.uuid4().hex[:6]}"
    base = dict(
        data=str(corpus),
        size="nano",
        seq_len=32,
        batch_size=8,
        steps=8000,  # about 80 s a run on an idle 2-core machine (2,500 took 25 s): longer than the 1-minute limit
        eval_every=0,
        eval_batches=1,
        probe_every=0,
        layout="pre",
        ckpt_every=500,
    )
    slurm = dict(
        timeout_min=1,
        cpus_per_task=1,
        slurm_partition="debug",
        slurm_qos="normlab-limited",
        slurm_array_parallelism=2,
        slurm_max_num_timeout=20,
    )
    toml = work / f"{name}.toml"
    toml.write_text(
        _to_toml(
            SweepConfig(name=name, base=base, grid={"seed": list(range(5))}, executor="slurm", slurm=slurm).to_dict()
        )
    )
    out = work / "sw"
    cmd = [sys.executable, "-m", "normlab", "sweep", str(toml), "--out", str(out)]
    job_name = f"normlab-{name}"

    broken: list[str] = []
    failed_seen: set[tuple] = set()
    stop = threading.Event()

    def monitor() -> None:  # twice a second: failed rows, and live jobs per run (never two)
        while not stop.is_set():
            for r in rows(out):
                if r["status"] == "failed":
                    failed_seen.add((r["run_id"], r["job"], r["reason"]))
            time.sleep(0.5)

    threading.Thread(target=monitor, daemon=True).start()
    t0 = time.time()

    def start(env: dict[str, str] = ENV) -> subprocess.Popen:
        return subprocess.Popen(
            cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    proc = start()
    wait("a run training", lambda: any(r["status"] == "running" for r in rows(out)))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    print(f"judge: {time.time() - t0:.0f}s: coordinator killed; rows {[(r['status'], r['job']) for r in rows(out)]}")
    victim = next(r for r in rows(out) if r["status"] == "running")
    subprocess.run(["scancel", victim["job"]], check=True)
    print(f"judge: scancel {victim['job']} ({victim['run_id']})")
    proc = start()
    time.sleep(20)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    print(
        f"judge: {time.time() - t0:.0f}s: coordinator killed again; rows {[(r['status'], r['job']) for r in rows(out)]}"
    )
    # a third life killed the moment sbatch accepts its first array (an `sbatch` first on PATH runs the real one, then
    # kill -9s its caller), before the coordinator stores the ids; killed after 120 s if it submits nothing by then
    killer = work / "bin"
    killer.mkdir(exist_ok=True)
    (killer / "sbatch").write_text(  # sbatch --test-only (the check before anything is written) passes through
        '#!/bin/sh\n[ "$1" = --test-only ] && exec /usr/bin/sbatch "$@"\n'
        'out=$(/usr/bin/sbatch "$@") || exit $?\necho "$out"\nkill -9 $PPID\n'
    )
    (killer / "sbatch").chmod(0o755)
    proc = start({**ENV, "PATH": f"{killer}:{ENV['PATH']}"})
    try:
        how = "as sbatch accepted" if proc.wait(timeout=120) == -signal.SIGKILL else "exited"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        how = "after 120 s (it submitted nothing)"
    print(
        f"judge: {time.time() - t0:.0f}s: coordinator killed {how}; rows {[(r['status'], r['job']) for r in rows(out)]}"
    )
    for attempt in range(3):
        done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=3000)
        print(f"judge: {time.time() - t0:.0f}s: rerun {attempt + 1} exit {done.returncode}")
        if all(r["status"] == "ok" for r in rows(out)):
            break
    stop.set()
    got, jobs = rows(out), sacct(job_name)
    for r in got:
        if r["status"] != "ok":
            broken.append(f"{r['run_id']} ended {r['status']}: {r['reason']}")
        elif r["worker"] != r["job"] or jobs.get(r["job"]) != "COMPLETED":
            broken.append(f"{r['run_id']}: row job {r['job']}, worker {r['worker']}, sacct {jobs.get(r['job'])}")
    for run_id, job, reason in sorted(failed_seen, key=str):
        if not jobs.get(job, "").startswith("CANCELLED"):
            broken.append(f"{run_id} was seen failed while its job {job} was {jobs.get(job)}: {reason}")
    broken += overlapping(out, job_name)
    # the scenario's premise: the one-minute limit made every run live in two or more jobs (each start counts)
    short = [f"{r['run_id']} ({r['attempts']})" for r in got if r["attempts"] < 2]
    if short:
        broken.append(f"runs that lived in one job only, so no time limit cut them: {', '.join(short)}")
    # no duplicate job: each job sacct knows of this sweep trained its run to the end (a row's job), is the one
    # scancel-ed, or ended on a limit without requeueing itself and was replaced (the coordinator's resubmission)
    finals = {r["job"] for r in got} | {victim["job"]}
    for job, state in sorted(jobs.items()):
        if job not in finals and state.split()[0] not in ("TIMEOUT", "NODE_FAIL", "BOOT_FAIL", "PREEMPTED"):
            broken.append(f"job {job} ended {state}: a duplicate (it is no run's job)")
    print(f"judge: {len(got)} runs, {sum(r['status'] == 'ok' for r in got)} ok; jobs {jobs}")
    print(f"judge: job lives per run: {sorted(r['attempts'] for r in got)}")
    print(f"judge: failed rows seen (cancelled jobs only allowed): {sorted(failed_seen, key=str)}")
    print(
        f"judge: {time.time() - t0:.0f}s in all; " + ("ALL HELD" if not broken else "BROKEN:\n  " + "\n  ".join(broken))
    )
    return 1 if broken else 0


if __name__ == "__main__":
    raise SystemExit(main())
