"""Where a launcher put this process: the value that each launcher's `detect(environ)` returns.

Pure: reading a launcher's environment variables needs no torch, so each launcher's detection is a plain
function of a dict, tested without starting that launcher.
"""

from __future__ import annotations

import enum
import zlib
from dataclasses import dataclass

from partita.errors import LaunchError


@dataclass(frozen=True)
class Address:
    """Host and port of the job's rendezvous (the TCP store that rank 0 serves)."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


class Join(enum.Enum):
    """How the ranks of a job find each other."""

    ALONE = "alone"  # one process: a private one-rank group
    ADOPT = "adopt"  # the launcher created the process group already (Ray Train)
    AGENT = "agent"  # torchrun's agent serves the store; torch's env:// rendezvous joins it
    STORE = "store"  # rank 0 serves partita's own store at `Placement.address`; the others join it


@dataclass(frozen=True)
class Placement:
    """This process's place in the job, as its launcher described it.

    >>> p = Placement("srun", rank=5, world_size=8, local_rank=1, local_world_size=4, num_nodes=2,
    ...               join=Join.STORE, address=Address("node01", 25001))
    >>> p.layout()
    '8 ranks = 2 nodes x 4 ranks per node'
    """

    launcher: str  # what started the process, for messages: torchrun, env, mpirun, srun, ray, single
    rank: int
    world_size: int
    local_rank: int = 0
    local_world_size: int = 1
    num_nodes: int = 1
    join: Join = Join.ALONE
    address: Address | None = None  # for Join.STORE; None until agreed (mpirun without MASTER_ADDR)
    detail: str = ""  # the launcher's own name for the job, e.g. "Slurm job 12 step 0"

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise LaunchError(
                f"{self.launcher} says this process is rank {self.rank} of a world of {self.world_size}; a rank "
                f"must be in 0..{self.world_size - 1}. Start every process with the same world size and its own rank."
            )
        if not 0 <= self.local_rank < self.local_world_size:
            raise LaunchError(
                f"{self.launcher} says this process is local rank {self.local_rank} of {self.local_world_size} on "
                "its node; a local rank must be below the number of ranks on the node."
            )

    def layout(self) -> str:
        """The world as nodes x ranks per node, e.g. for the log line of rank 0."""
        nodes = f"{self.num_nodes} node{'s' if self.num_nodes > 1 else ''}"
        if self.num_nodes * self.local_world_size == self.world_size:
            return f"{self.world_size} ranks = {nodes} x {self.local_world_size} ranks per node"
        return f"{self.world_size} ranks on {nodes}"


def nodes_for(world_size: int, local_world_size: int) -> int:
    """Number of nodes when a launcher does not say: the world in full nodes of `local_world_size` ranks."""
    return -(-world_size // max(1, local_world_size))


def integer(environ: dict, name: str) -> int:
    """An integer launcher variable, with an error that names it when it is not one."""
    try:
        return int(environ[name])
    except ValueError:
        raise LaunchError(f"environment variable {name}={environ[name]!r} should be an integer") from None


def job_port(job_id: str) -> int:
    """A port that every rank derives from its launcher's job id, so that ranks agree on it without talking.

    crc32 rather than hash(): Python salts str hashes per process. The range stays below Linux's ephemeral
    ports (32768+), where the kernel picks ports for outgoing connections.

    >>> job_port("12.0") == job_port("12.0") and 20000 <= job_port("12.0") < 30000
    True
    """
    return 20000 + zlib.crc32(job_id.encode()) % 10000
