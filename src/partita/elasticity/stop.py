"""Requests to stop at the next step boundary: SIGTERM, SIGUSR1, or a stop file.

SIGTERM is what torchrun's agent, mpirun, Kubernetes and spot-VM preemption send before killing a process;
SIGUSR1 is Slurm's warning before the time limit (and a way to ask a running job to checkpoint and
re-plan). The batch scripts of `partita slurm` catch Slurm's warning in the shell and create the file named
by PARTITA_STOP_FILE, because a signal to the batch shell does not reach the ranks.

A handler only records the request; the training loop acts on it between steps, where the model, optimizer
and data position are consistent.
"""

from __future__ import annotations

import os
import signal
import threading

from partita import settings

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
RESUME_EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): stopped on request after saving; run again to resume


class StopRequest:
    """Records SIGTERM / SIGUSR1 while installed; `reason()` says whether and why to stop."""

    def __init__(self, stop_file: str | None = None):
        self.stop_file = stop_file if stop_file is not None else settings.stop_file()
        self.received: str | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> "StopRequest":
        # Python runs handlers only in the main thread, and only the main thread may install them
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._record)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _record(self, signum, frame) -> None:
        self.received = signal.Signals(signum).name

    def reason(self) -> str | None:
        """Why this process should stop ('SIGTERM', 'SIGUSR1', 'stop file ...'), or None."""
        if self.received:
            return self.received
        if self.stop_file and os.path.exists(self.stop_file):
            return f"stop file {self.stop_file}"
        return None
