"""A pool of worker processes that form one gloo job and run test cases on every rank.

Starting a process that imports torch costs about a second on these machines; a pool started once per
world size serves many tests. Workers come from a forkserver with torch (and partita) preloaded. A case is
a function named by "module:function" that every rank calls with the same arguments; each rank's return
value comes back to the test. A case that fails or hangs breaks the pool: the test fails with every rank's
traceback, and the next test gets a fresh pool. Process groups use a short timeout, so a hang inside a
collective ends by itself; the pool's own deadline catches everything else.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
from pathlib import Path

from support.session import cache_dir

ROOT = Path(__file__).resolve().parents[2]
PRELOAD = ["torch", "torch.distributed", "torch.distributed.pipelining", "torch.export", "partita"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, conn, env: dict) -> None:
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    for p in (str(ROOT / "tests"), str(ROOT / "examples"), str(ROOT / "src")):
        if p not in sys.path:
            sys.path.insert(0, p)
    import partita

    try:
        partita.init()
    except Exception:  # noqa: BLE001 - reported to the test
        conn.send(("err", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        name, args, kwargs = msg
        try:
            module, fn = name.split(":")
            result = getattr(importlib.import_module(module), fn)(*args, **kwargs)
            conn.send(("ok", result))
        except BaseException:  # noqa: BLE001 - reported to the test
            conn.send(("err", traceback.format_exc()))
            break
    try:
        partita.shutdown()
    except Exception:  # noqa: BLE001 - the pool is going away either way
        pass
    os._exit(0)


class CaseFailed(AssertionError):
    pass


class Pool:
    def __init__(self, world: int, timeout_s: float = 30.0):
        self.world = world
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        port = free_port()
        env = {"OMP_NUM_THREADS": "1", "PARTITA_TIMEOUT_S": str(timeout_s), "PYTHONPATH": str(ROOT / "src"),
               "TRANSFORMERS_VERBOSITY": "error", "PARTITA_LOG": "off", "PARTITA_CACHE_DIR": cache_dir()}
        self.conns, self.procs = [], []
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, world, port, child, env), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        self.broken = False
        self._collect(120.0, "start-up")

    def _collect(self, deadline_s: float, what: str) -> list:
        end = time.monotonic() + deadline_s
        results: list = [None] * self.world
        errors: dict[int, str] = {}
        pending = set(range(self.world))
        while pending:
            left = end - time.monotonic()
            if left <= 0:
                break
            for r in list(pending):
                if self.conns[r].poll(min(0.05, max(left, 0))):
                    try:
                        status, value = self.conns[r].recv()
                    except EOFError:
                        status, value = "err", f"rank {r} exited (code {self.procs[r].exitcode})"
                    pending.discard(r)
                    if status == "err":
                        errors[r] = value
                    else:
                        results[r] = value
                elif not self.procs[r].is_alive():
                    pending.discard(r)
                    errors[r] = f"rank {r} died (exit code {self.procs[r].exitcode})"
            if errors and pending:
                # a failed rank leaves the others in a collective; give them the PG timeout to report
                end = min(end, time.monotonic() + float(os.environ.get("PARTITA_TEST_GRACE_S", 40)))
        if pending:
            errors.update({r: f"rank {r} did not finish {what} within {deadline_s:.0f} s" for r in pending})
        if errors:
            self.broken = True
            self.close()
            text = "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
            raise CaseFailed(f"{what} failed on ranks {sorted(errors)}:\n{text}")
        return results

    def run(self, name: str, *args, deadline_s: float = 180.0, **kwargs) -> list:
        if self.broken:
            raise CaseFailed("pool is broken")
        for c in self.conns:
            c.send((name, args, kwargs))
        return self._collect(deadline_s, name)

    def close(self) -> None:
        for c, p in zip(self.conns, self.procs):
            try:
                if p.is_alive() and not self.broken:
                    c.send(None)
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 10
        for p in self.procs:
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)


class Pools:
    """One live pool per world size, replaced when broken."""

    def __init__(self):
        self.pools: dict[int, Pool] = {}

    def get(self, world: int) -> Pool:
        pool = self.pools.get(world)
        if pool is None or pool.broken:
            self.pools[world] = pool = Pool(world)
        return pool

    def run(self, world: int, name: str, *args, **kwargs) -> list:
        return self.get(world).run(name, *args, **kwargs)

    def close(self) -> None:
        for p in self.pools.values():
            p.close()
        self.pools.clear()
