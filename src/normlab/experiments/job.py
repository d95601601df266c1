"""One run of a sweep as a scheduler job (`normlab.experiments.cluster`): a submitit Checkpointable, so that SLURM's
USR2 (a time limit near, a preemption) saves the run and requeues the job. Its own module: submitit is imported
only where a job is submitted or runs."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from submitit.helpers import Checkpointable, DelayedSubmission

from normlab.experiments.execute import execute_run
from normlab.experiments.scheduler import HELD_LINE, allocation_threads
from normlab.runs.lock import job_id


class RunJob(Checkpointable):
    """One run of a sweep as a scheduler job: trains in a thread, so that submitit's signal handler (USR2, in
    the main thread) can ask the run to stop at its next step and wait for its checkpoint (`checkpoint`). SIGTERM
    (a cancel, or a time limit reached without the warning) stops it the same way, without a requeue.

    An exception that escapes the run (one `execute_run` could not record: torch failing to import under a memory
    limit of `slurm_setup`, the store unreachable) is raised again in the main thread once the thread ends, so the
    job exits non-zero (sacct FAILED) with the traceback in its log, and the coordinator reports it; a job that
    found its run held by another process says so in one line of its log (`scheduler.HELD_LINE`)."""

    def __init__(self, sweep_dir: str, run_id: str) -> None:
        self.sweep_dir, self.run_id = sweep_dir, run_id
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None
        self._result: dict[str, Any] = {}
        self._error: BaseException | None = None

    def __getstate__(self) -> dict[str, Any]:  # pickled for submission: no thread, no event
        return {"sweep_dir": self.sweep_dir, "run_id": self.run_id}

    def __setstate__(self, state: dict[str, Any]) -> None:
        RunJob.__init__(self, state["sweep_dir"], state["run_id"])

    def __call__(self) -> dict[str, Any]:
        threads = allocation_threads()
        if threads:
            os.environ["OMP_NUM_THREADS"] = str(threads)
            print(
                f"normlab: {self.run_id} in job {job_id()}: {threads} torch thread(s), from the allocation", flush=True
            )
        self._stop = stop = threading.Event()
        # scancel (and a time limit without the USR2 warning) sends SIGTERM, then SIGKILL after the cluster's
        # KillWait: the run saves after its step and the job ends (submitit would let it train on until killed)
        signal.signal(signal.SIGTERM, lambda *_: stop.set())

        def work() -> None:
            try:
                self._result = execute_run(
                    self.sweep_dir, self.run_id, threads=threads, stop=self._stop, worker=job_id()
                )
            except BaseException as err:  # noqa: BLE001 - raised again in the main thread: the job must fail
                self._error = err

        self._thread = threading.Thread(target=work, name=f"normlab-{self.run_id}")
        self._thread.start()
        while self._thread.is_alive():
            self._thread.join(0.5)  # short joins: the USR2 handler runs here, between them
        # the run is over: a USR2 or SIGTERM from now on (its time limit near) would kill the exiting process (Python
        # puts back the default action as it exits), and sacct would say FAILED for a run that ended ok
        for sig in (signal.SIGUSR2, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        if self._error is not None:  # the job exits non-zero, the traceback in its log (submitit prints it)
            if isinstance(self._error, Exception):
                raise self._error
            raise RuntimeError(f"the run's thread ended with {type(self._error).__name__}: {self._error}")
        if self._result.get("holder_job") is not None or self._result.get("status") == "running":
            print(f"normlab: {self.run_id}: {HELD_LINE} ({self._result.get('reason')})", flush=True)
        return self._result

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """submitit's hook on USR2 (time limit or preemption): the run saves at its next step, then the job is
        requeued with a fresh RunJob, which continues from that checkpoint."""
        if self._stop is not None and self._thread is not None:
            self._stop.set()
            self._thread.join()
        return DelayedSubmission(RunJob(self.sweep_dir, self.run_id))
