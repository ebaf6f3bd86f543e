"""Processes started by Open MPI's `mpirun` (RaNNC's launcher): `mpirun -np 8 python train.py` needs nothing else.

torch's CPU wheel has no MPI backend, so MPI only launches: the ranks train over gloo and meet at a rendezvous
address that they agree on without the user setting MASTER_ADDR (see `agree_address`).

>>> p = detect({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
...             "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_orte_num_nodes": "2"})
>>> (p.rank, p.local_rank, p.layout())
(3, 1, '4 ranks = 2 nodes x 2 ranks per node')
"""

from __future__ import annotations

import socket
from dataclasses import replace

from partita.errors import LaunchError
from partita.launch.detected import Address, Join, Placement, integer, job_port, nodes_for


def detect(environ: dict) -> Placement | None:
    """Open MPI's OMPI_COMM_WORLD_* variables, or None. MASTER_ADDR/MASTER_PORT, when both set, fix the address."""
    if "OMPI_COMM_WORLD_SIZE" not in environ:
        return None
    world_size = integer(environ, "OMPI_COMM_WORLD_SIZE")
    local_world_size = integer(environ, "OMPI_COMM_WORLD_LOCAL_SIZE")
    nodes = (integer(environ, "OMPI_MCA_orte_num_nodes") if "OMPI_MCA_orte_num_nodes" in environ
             else nodes_for(world_size, local_world_size))
    given = "MASTER_ADDR" in environ and "MASTER_PORT" in environ
    return Placement("mpirun", integer(environ, "OMPI_COMM_WORLD_RANK"), world_size,
                     integer(environ, "OMPI_COMM_WORLD_LOCAL_RANK"), local_world_size, nodes, Join.STORE,
                     Address(environ["MASTER_ADDR"], integer(environ, "MASTER_PORT")) if given else None)


def agree_address(me: Placement, environ: dict) -> Placement:
    """`me` with the rendezvous address every rank agrees on.

    With mpi4py, rank 0 picks its host and a free port and broadcasts them. Without it, ranks on one node meet
    on 127.0.0.1 at a port derived from the MPI job id; ranks on several nodes cannot agree on a host, and
    the error says what to install or set.
    """
    if me.address is not None:
        return me
    comm = _mpi_world()
    if comm is not None:
        mine = ("127.0.0.1" if me.num_nodes == 1 else socket.gethostname(), _free_port()) if me.rank == 0 else None
        return replace(me, address=Address(*comm.bcast(mine, root=0)), detail="address broadcast with mpi4py")
    job = environ.get("OMPI_MCA_ess_base_jobid") or environ.get("PMIX_NAMESPACE")
    if me.num_nodes == 1 and job:
        return replace(me, address=Address("127.0.0.1", job_port(job)), detail=f"port from MPI job {job}")
    raise LaunchError(
        f"mpirun started {me.world_size} ranks on {me.num_nodes} nodes, and partita cannot agree on a rendezvous "
        "address for them: install mpi4py in this Python (`pip install mpi4py`), which lets rank 0 broadcast "
        "one, or give every rank the first node's address: "
        "`mpirun -x MASTER_ADDR=<first host> -x MASTER_PORT=29500 ...`."
    )


def _free_port() -> int:
    """A port nobody listens on now (the kernel's choice); another process could take it before we bind it."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _mpi_world():
    """mpi4py's COMM_WORLD, or None where mpi4py or the MPI library it needs is missing."""
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError):
        return None
    return MPI.COMM_WORLD
