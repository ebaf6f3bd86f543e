"""Checkpoint files in one process (no process group): export, refusing pickled code, damaged and foreign
checkpoints, and a save killed while it writes."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import partita
from partita.checkpoint import export, latest_checkpoint
from partita.checkpoint.owner import JOB_LOCK
from partita.cli.main import main as cli
from partita.errors import CheckpointError
from support.checkpoint_cases import trained
from support.zoo import CASES, TiedEmbedding

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}


@pytest.fixture
def saved(tmp_path):
    model, opt = trained()
    path = partita.save(model, opt, tmp_path, step=5, extra={"batch": 40})
    return tmp_path, Path(path), model


class RunsShell:
    """Unpickling this runs a shell command: what a malicious checkpoint would carry."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_export_cli_writes_a_file_a_plain_module_loads(saved, tmp_path):
    root, _, model = saved
    out = tmp_path / "exported" / "model.pt"
    done = subprocess.run([sys.executable, "-m", "partita.cli.main", "export", str(root), str(out)],
                          capture_output=True, text=True, env=_env(), timeout=120)
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stdout and "step 5" in done.stdout
    plain = CASES["tied_embedding"].make()
    plain.load_state_dict(torch.load(out, weights_only=True))  # strict: every name, tied ones included
    for name, value in model.state_dict().items():
        assert torch.equal(plain.state_dict()[name], value), name


def test_export_cli_names_the_problem(tmp_path, capsys):
    assert cli(["export", str(tmp_path), str(tmp_path / "out.pt")]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "out.pt").exists()


def test_load_round_trip_in_one_process(saved):
    root, path, model = saved
    fresh, opt = trained(seed=7)
    info = partita.load(fresh, opt, root)
    assert (info.path, info.step, info.extra, info.world_size, info.plan) == (str(path), 5, {"batch": 40}, 1, None)
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name


def test_saving_a_model_built_on_meta_before_its_first_call_says_why_not(saved, tmp_path):
    """Its tensors get their values at the first call (here from the checkpoint loaded before it)."""
    root, _, _ = saved
    case = CASES["tied_embedding"]
    with torch.device("meta"):
        meta = case.make()
    opt = torch.optim.Adam(meta.parameters())
    pm = partita.parallelize(meta, opt, loss_fn=case.loss_fn)
    partita.load(pm, opt, root)
    with pytest.raises(CheckpointError, match=r"on the meta device: .*Save after the model's first call"):
        partita.save(pm, opt, tmp_path, step=6)
    partita.shutdown()


def test_malicious_metadata_is_refused_without_running_it(saved, tmp_path):
    root, path, _ = saved
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(RunsShell(f"touch {marker}"), protocol=4))
    fresh, opt = trained(seed=7)
    with pytest.raises(CheckpointError, match=r"refused to load .*\.metadata.*posix\.system"):
        partita.load(fresh, opt, root)
    with pytest.raises(CheckpointError, match="refused"):
        export(root, tmp_path / "out.pt")
    assert not marker.exists()
    with open(path / ".metadata", "rb") as f:  # the payload is live: plain pickle, as DCP uses, runs it
        pickle.load(f)
    assert marker.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_malicious_item_is_refused_without_running_it(saved, tmp_path, monkeypatch):
    monkeypatch.setenv("PARTITA_UNVERIFIED_CHECKPOINTS", "on")  # the forger's checkpoint passes the checksums' check
    """A checkpoint whose non-tensor item (the step) unpickles into a shell command."""
    root, path, model = saved
    marker = tmp_path / "pwned"
    forged = root / "step-000006"
    items = {f"model.{n}": t for n, t in model.state_dict().items()}
    items.update(step=RunsShell(f"touch {marker}"), extra="{}")
    dcp.save(items, storage_writer=dcp.FileSystemWriter(forged), no_dist=True,
             planner=dcp.DefaultSavePlanner(flatten_state_dict=False))
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["checksums"]  # a forger who knows the format leaves no checksum to contradict the files
    (forged / "manifest.json").write_text(json.dumps(manifest))
    fresh = CASES["tied_embedding"].make()
    with pytest.raises(CheckpointError, match="refused to load the checkpoint's item 'step'"):
        partita.load(fresh, None, forged)
    assert not marker.exists()


def _random_bytes(path: Path) -> None:
    (path / ".metadata").write_bytes(os.urandom(2000))


def _delete_data(path: Path) -> None:
    (path / "__0_0.distcp").unlink()


def _truncate_data(path: Path) -> None:
    data = path / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:1000])


def _scramble_data(path: Path) -> None:
    data = path / "__0_0.distcp"
    data.write_bytes(os.urandom(data.stat().st_size))


def _no_manifest(path: Path) -> None:
    (path / "manifest.json").unlink()


def _garbage_manifest(path: Path) -> None:
    (path / "manifest.json").write_text("{not json")


@pytest.mark.parametrize("damage,message", [
    (_random_bytes, r"\.metadata is corrupt"),
    (_delete_data, r"incomplete: its data file __0_0\.distcp is missing"),
    (_truncate_data, r"incomplete: its data file __0_0\.distcp has 1000 bytes"),
    (_scramble_data, r"damaged: its file __0_0\.distcp changed after it was saved"),
    (_no_manifest, r"torch\.distributed\.checkpoint directory but not a partita checkpoint"),
    (_garbage_manifest, r"not a readable partita manifest"),
])
def test_damaged_checkpoint_gets_a_clear_error(saved, damage, message):
    root, path, _ = saved
    damage(path)
    fresh, opt = trained(seed=7)
    with pytest.raises(CheckpointError, match=message):
        partita.load(fresh, opt, path)


@pytest.mark.parametrize("make,optimizer,message", [
    (CASES["mlp"].make, None, r"does not fit this model: 12 of the model's tensors are not in it \(layers\.0\.weight, "
                              r".*; 6 of its tensors are not in the model \(emb\.weight"),
    (lambda: TiedEmbedding(vocab=40), None, r"2 tensors have other shapes \(emb\.weight: \[50, 16\] saved, "
                                            r"\[40, 16\] here"),
    (TiedEmbedding, "sgd", r"holds Adam state, but the optimizer is SGD"),
], ids=["other-model", "other-shapes", "other-optimizer"])
def test_foreign_checkpoint_gets_a_clear_error(saved, make, optimizer, message):
    root, _, _ = saved
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1) if optimizer == "sgd" else None
    with pytest.raises(CheckpointError, match=message):
        partita.load(model, opt, root)


@pytest.mark.parametrize("make_path,message", [
    (lambda root: root / "nowhere", "does not exist"),
    (lambda root: root / "latest", "is a file, not a checkpoint"),
    (lambda root: (root / "empty").mkdir() or root / "empty", "no complete checkpoint"),
])
def test_no_checkpoint_there(saved, make_path, message):
    root, _, _ = saved
    model, opt = trained()
    with pytest.raises(CheckpointError, match=message):
        partita.load(model, opt, make_path(root))


def test_latest_falls_back_to_the_newest_complete_checkpoint(saved):
    root, path, model = saved
    second = partita.save(model, None, root, step=3)  # a lower step saved later is the newer checkpoint
    assert latest_checkpoint(root) == second
    (root / "latest").write_text("step-000999\n")
    assert latest_checkpoint(root) == second
    (root / "latest").unlink()
    assert latest_checkpoint(root) == second
    assert latest_checkpoint(root / "missing") is None


def test_a_save_stopped_before_it_pointed_latest_at_itself_is_still_the_latest(saved):
    """Its checkpoint was renamed into place, complete; `latest` still names the one before."""
    root, path, model = saved
    second = partita.save(model, None, root, step=6)
    (root / "latest").write_text(f"{path.name}\n")
    assert latest_checkpoint(root) == second


def test_finding_the_latest_checkpoint_needs_no_torch(saved):
    root, path, _ = saved
    code = ("import sys; sys.modules['torch'] = None; import partita; "
            f"print(partita.latest_checkpoint({str(root)!r}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == str(path), done.stderr


KILLED_SAVE = textwrap.dedent("""
    import os, signal, sys, threading, time
    import torch, partita

    root = sys.argv[1]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(16)])  # 64 MiB
    partita.save(model, None, root, step=1)
    with torch.no_grad():
        model[0].weight.add_(1.0)

    def kill_once_data_is_being_written():
        while True:
            for d in os.listdir(root):
                if ".tmp-" in d and any(f.endswith(".distcp") for f in os.listdir(os.path.join(root, d))):
                    os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.0005)

    threading.Thread(target=kill_once_data_is_being_written, daemon=True).start()
    partita.save(model, None, root, step=2)
    print("the save finished before it could be killed")
""")


def test_a_save_killed_while_writing_leaves_the_previous_checkpoint(tmp_path):
    script = tmp_path / "killed_save.py"
    script.write_text(KILLED_SAVE)
    root = tmp_path / "ckpt"
    done = subprocess.run([sys.executable, str(script), str(root)], capture_output=True, text=True, env=_env(),
                          timeout=180)
    assert done.returncode == -signal.SIGKILL, (done.returncode, done.stdout, done.stderr)
    unfinished = [p.name for p in root.iterdir() if ".tmp-" in p.name]
    assert len(unfinished) == 1 and unfinished[0].startswith("step-000002.tmp-")
    assert latest_checkpoint(root) == str(root / "step-000001")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(16)])
    want = {n: t.clone() for n, t in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    assert partita.load(model, None, root).step == 1
    for name, value in want.items():
        assert torch.equal(model.state_dict()[name], value), name
    partita.save(model, None, root, step=3)  # the next save clears what the killed one left
    assert sorted(p.name for p in root.iterdir() if p.name != JOB_LOCK) == ["latest", "step-000001", "step-000003"]


def test_docstring_examples():
    import doctest

    from partita.checkpoint import exporting, keys, layout, loading, saving

    for module in (keys, layout, saving, loading, exporting):
        assert doctest.testmod(module).failed == 0, module.__name__


OTHER_JOB_SAVE = textwrap.dedent("""
    import sys, time, pathlib, torch, partita
    from torch.distributed.checkpoint import FileSystemWriter

    root, go = sys.argv[1], pathlib.Path(sys.argv[2])
    write = FileSystemWriter.write_data

    def wait_after_writing(self, plan, planner):  # a big checkpoint: its data takes a while to write
        written = write(self, plan, planner)
        while not go.exists():
            time.sleep(0.05)
        return written

    FileSystemWriter.write_data = wait_after_writing
    print(partita.save(torch.nn.Linear(4, 2), None, root, step=20))
""")


def test_a_save_keeps_another_attempts_save_in_progress(tmp_path, monkeypatch):
    """Two attempts of one job (an elastic restart, the earlier attempt's process still ending; another job is
    refused the directory, `checkpoint.owner`) save into one directory: the one that starts its save while the
    other writes leaves the other's temporary directory alone, and both checkpoints are complete."""
    script, root, go = tmp_path / "other_job.py", tmp_path / "ckpt", tmp_path / "go"
    script.write_text(OTHER_JOB_SAVE)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    other = subprocess.Popen([sys.executable, str(script), str(root), str(go)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=dict(_env(), SLURM_JOB_ID="4242"))
    try:
        deadline = time.monotonic() + 120
        while not any(root.glob("step-000020.tmp-*/*.distcp")):
            assert other.poll() is None and time.monotonic() < deadline, other.communicate()
            time.sleep(0.05)
        mine = partita.save(torch.nn.Linear(4, 2), None, root, step=10)
    finally:
        go.touch()
        out, err = other.communicate(timeout=120)
    assert other.returncode == 0, err
    assert out.strip() == str(root / "step-000020") and Path(mine) == root / "step-000010"
    assert sorted(p.name for p in root.iterdir() if p.name != JOB_LOCK) == ["latest", "step-000010", "step-000020"]


@pytest.mark.parametrize("extra, where, key", [
    ({"rows_seen_by_rank": {0: 128, 1: 96}}, "extra['rows_seen_by_rank']", "0 (int)"),
    ({"shards": [{"done": True}, {(1, 2): 3}]}, "extra['shards'][1]", "(1, 2) (tuple)"),
    ({None: 1}, "extra", "None (NoneType)"),
])
def test_extra_with_keys_json_would_turn_into_strings_is_refused(tmp_path, extra, where, key):
    """JSON turns dict keys into strings: {0: 128} would load as {'0': 128}, and .get(0) would silently miss."""
    net = torch.nn.Linear(4, 2)
    with pytest.raises(CheckpointError) as raised:
        partita.save(net, torch.optim.SGD(net.parameters(), lr=0.1), tmp_path, step=1, extra=extra)
    assert f"{where} has the key {key}" in str(raised.value) and "Use string keys" in str(raised.value)
    assert latest_checkpoint(tmp_path) is None
