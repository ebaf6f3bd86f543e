"""The agent of `partita run`: torch's LocalElasticAgent, except that a rank stopped by a signal is killed at once.

Whenever torch stops the ranks of an attempt (one rank failed: its process context closes the others as soon as it
sees the failure; a restart; the agent itself was signalled), it sends them SIGTERM, waits for them to exit (30 s;
--stop-timeout when the agent was signalled) and only then sends SIGKILL. A rank stopped by SIGSTOP cannot act on
SIGTERM until something continues it, so that wait always ran out in full, long after the rank's peers had named
it: such a rank gets SIGKILL first, and the others SIGTERM as before.

torch 2.11's agent has no wait of its own for a signalled agent (2.13: `LaunchConfig.shutdown_timeout`): there,
every wait is --stop-timeout (`config_fields` says which torch this is).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
from collections.abc import Iterator

from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.launcher import api as launcher_api

from partita.launch.peers import stopped_child


class Agent(LocalElasticAgent):
    killed: set[int] = set()  # the ranks killed for being stopped, for `partita run`'s summary of the failure
    stop_timeout_s: int = 30  # torch 2.11: how long the ranks get after SIGTERM (set by `installed`)

    def _start_workers(self, worker_group):
        started = super()._start_workers(worker_group)
        # torch 2.13 closes the ranks from inside the process context (its poll, on a failure) as well as from the
        # agent, and always through `close`: the context's own, which no subclass of the agent can replace
        close = self._pcontext.close

        def close_killing_stopped(death_sig: signal.Signals | None = None, timeout: int | None = None) -> None:
            self._kill_stopped(death_sig or signal.SIGTERM)
            close(death_sig, Agent.stop_timeout_s if timeout is None else timeout)

        self._pcontext.close = close_killing_stopped
        return started

    def _kill_stopped(self, death_sig: signal.Signals) -> None:
        for local_rank, pid in self._pcontext.pids().items():
            if not stopped_child(pid):
                continue
            rank = self.get_worker_group().workers[local_rank].global_rank
            print(f"partita run: rank {rank} (process {pid}) is stopped (SIGSTOP) and would not act on "
                  f"{death_sig.name}: killed it with SIGKILL", file=sys.stderr, flush=True)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended since
                continue
            Agent.killed.add(rank)


def config_fields(stop_timeout_s: int) -> dict[str, int]:
    """What `launcher_api.LaunchConfig` takes of the wait after SIGTERM: its field on torch 2.13, nothing on 2.11
    (`installed` gives the agent that wait there)."""
    names = {f.name for f in dataclasses.fields(launcher_api.LaunchConfig)}
    return {"shutdown_timeout": stop_timeout_s} if "shutdown_timeout" in names else {}


@contextlib.contextmanager
def installed(stop_timeout_s: int) -> Iterator[None]:
    """`launch_agent` takes no agent class: it builds the one its module names LocalElasticAgent, which names
    Agent while this lasts."""
    launcher_api.LocalElasticAgent = Agent
    Agent.stop_timeout_s = 30 if config_fields(stop_timeout_s) else stop_timeout_s
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = LocalElasticAgent
