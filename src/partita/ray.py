"""Train on a Ray cluster: `partita.ray.run(train_fn, workers=N)` runs `train_fn` in N Ray Train workers.

It is Ray Train's TorchTrainer with what partita needs set for you: CPUs per worker that fit the cluster, a
process-group timeout of PARTITA_TIMEOUT_S, a run name of its own (Ray resumes a run whose name it has
seen), PARTITA_* settings passed on to the workers, and a clear error, not a wait, when no cluster answers at
the address or when the cluster is too small. Inside `train_fn`, `partita.init()` adopts Ray's process group.

The 2-D example of Ray's users (4 layers, 2 pipeline stages, on 2 nodes of 2 devices) is a plain model:

    import torch, partita, partita.ray

    def train(config):
        partita.init()                                  # rank, world and process group come from Ray
        model = torch.nn.Sequential(*[torch.nn.Linear(50, 50) for _ in range(3)], torch.nn.Linear(50, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        model = partita.parallelize(model, opt, loss_fn=torch.nn.MSELoss(), stages=2)  # 2 stages x 2 replicas
        for step in range(config["steps"]):
            opt.zero_grad()
            model(torch.randn(32, 50), torch.randn(32, 4)).backward()
            opt.step()
        partita.shutdown()

    partita.ray.run(train, workers=4, address="auto", config={"steps": 10})   # `ray start --head` made "auto"
"""

from __future__ import annotations

import functools
import os
import runpy
import socket
import sys
import uuid

from partita.errors import LaunchError


def run(train_fn, workers: int, *, address: str | None = None, config: dict | None = None,
        cpus_per_worker: float | None = None, use_gpu: bool = False, storage_path: str | None = None,
        connect_timeout_s: float = 10.0, max_failures: int = 0):
    """Run `train_fn(config)` (or `train_fn()` when config is None) in `workers` Ray Train workers.

    address: a running cluster ("HOST:6379", "ray://HOST:10001", or "auto": the one that `ray start` started
    last on this machine); None: RAY_ADDRESS when set, else a new local cluster for this call only, which stops
    with it (also when `ray start` left one running here). Either address must answer within
    `connect_timeout_s`. cpus_per_worker: default 1, or the cluster's CPUs shared by the workers when fewer.
    max_failures: how often Ray Train restarts every worker after one failed (or stopped to be resumed);
    a `train_fn` that uses `partita.elastic` continues from its latest checkpoint. Returns Ray's `Result`;
    a worker that fails once more raises Ray's `TrainingFailedError` with the worker's error.
    """
    try:
        import ray
    except ImportError:
        raise LaunchError("Ray is not installed in this Python: `pip install 'ray[default,train]'`.") from None
    connected_here = not ray.is_initialized()
    if connected_here:
        _connect(ray, address, connect_timeout_s)
    try:
        return _fit(ray, train_fn, workers, config, cpus_per_worker, use_gpu, storage_path, max_failures)
    finally:
        if connected_here:  # a cluster that this call started stops with it; a remote one only loses this driver
            ray.shutdown()


def _fit(ray, train_fn, workers, config, cpus_per_worker, use_gpu, storage_path, max_failures):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from partita.launch.env import timeout

    available = ray.cluster_resources()
    cpus = cpus_per_worker or min(1.0, available.get("CPU", 0) / workers)
    _check_resources(available, workers, cpus, use_gpu)
    trainer = TorchTrainer(
        train_fn, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=use_gpu, resources_per_worker={"CPU": cpus}),
        torch_config=TorchConfig(timeout_s=int(timeout().total_seconds())),
        # a name of its own: Ray resumes the checkpoint of a run whose name it has seen
        run_config=RunConfig(name=f"partita-{uuid.uuid4().hex[:8]}", storage_path=storage_path,
                             failure_config=FailureConfig(max_failures=max_failures)),
    )
    return trainer.fit()


def script_fn(script: str, args: list[str]):
    """A training function that runs `script args...` as `python script args...` would, in each worker.

    `partita ray` trains a script with it: `run(script_fn("train.py", ["--steps", "10"]), workers=4)`.
    """
    return functools.partial(_run_script, os.path.abspath(script), list(args))


def _run_script(path: str, args: list[str]) -> None:
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(path))  # as `python path` does, so that the script's own imports work
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise RuntimeError(f"{path} exited with status {e.code}") from None


def _connect(ray, address: str | None, connect_timeout_s: float) -> None:
    """Connect to the cluster at `address`, else at RAY_ADDRESS, once it answers; else start a local cluster.
    Raise a LaunchError that says why not."""
    from_environment = not address and bool(os.environ.get("RAY_ADDRESS"))
    # not ray.init(address=None): it would join the cluster that `ray start` started last on this machine, which
    # ray.shutdown() leaves running; "local" starts one of this call's own, which ray.shutdown() stops
    target = address or os.environ.get("RAY_ADDRESS") or "local"
    if target != "local":
        target = _bootstrap(target)
        _probe(target, connect_timeout_s, from_environment)
    forwarded = {k: v for k, v in os.environ.items() if k.startswith("PARTITA_")}
    ray.init(address=target, runtime_env={"env_vars": forwarded} if forwarded else None)


def _bootstrap(address: str) -> str:
    """The HOST:PORT that "auto" stands for (RAY_ADDRESS, or the cluster that `ray start` started last on this
    machine, as Ray finds it); any other address as it is."""
    if address != "auto":
        return address
    from ray._private.services import canonicalize_bootstrap_address, find_bootstrap_address

    # after RAY_ADDRESS, the address `ray start` recorded: ray.init("auto") would take any other running cluster
    # before it whenever there is one, even when the recorded one has died (its "legacy" fallback)
    recorded = None if os.environ.get("RAY_ADDRESS") else find_bootstrap_address(None)
    if recorded:
        return recorded
    try:
        return canonicalize_bootstrap_address("auto")  # what ray.init(address="auto") does
    except ConnectionError:
        raise LaunchError("the Ray address is auto, but no Ray cluster runs on this machine. Start one with `ray "
                          "start --head`, pass the address of another (HOST:6379), or leave the address out to start "
                          "a local cluster.") from None


def _probe(address: str, timeout_s: float, from_environment: bool) -> None:
    """A bounded TCP connect first: ray.init retries an address that does not answer for a long time."""
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as e:
        named, instead = ("RAY_ADDRESS ", "unset RAY_ADDRESS") if from_environment else ("", "leave the address out")
        raise LaunchError(
            f"no Ray cluster answers at {named}{address} ({e}; waited up to {timeout_s:g} s). Start one with "
            f"`ray start --head` and pass the address it prints (HOST:6379), or {instead} to start a local cluster."
        ) from None


def _check_resources(available: dict, workers: int, cpus: float, use_gpu: bool) -> None:
    """Refuse at once what the cluster cannot run: Ray Train would wait for the resources forever."""
    need = {"CPU": workers * cpus, **({"GPU": workers} if use_gpu else {})}
    short = [f"{k}: {v:g} needed, {available.get(k, 0):g} in the cluster" for k, v in need.items()
             if v > available.get(k, 0) + 1e-9]
    if short:
        raise LaunchError(f"the Ray cluster is too small for {workers} workers ({'; '.join(short)}). Use fewer "
                          "workers, fewer CPUs per worker, or add nodes (`ray start --address HEAD:6379`).")
