"""Checkpoints that are wrong inside, in one process: a value changed in place (the checksum of each file), a
malformed `.metadata`, and what partita says when torch's weights-only unpickler refuses an item."""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
import struct
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint.metadata import MetadataIndex

import partita
from partita.checkpoint import checksums, export
from partita.checkpoint.manifest import read_manifest
from partita.checkpoint.owner import JOB_LOCK
from partita.checkpoint.unpickling import read_metadata
from partita.cli.main import main as cli
from partita.errors import CheckpointError
from support.checkpoint_cases import trained
from support.zoo import CASES

ADVICE = ("weights_only` set to `False", "will likely succeed", "can still be loaded", "add_safe_globals",
          "trusted source", "trust the source")


@pytest.fixture
def partita_log(caplog, monkeypatch):
    """The records of the "partita" logger (which stops propagating once partita logs to stderr itself), from a
    process that has not yet said that a checkpoint is unverified."""
    monkeypatch.setattr(checksums, "_said_unverified", False)
    logger = logging.getLogger("partita")
    logger.addHandler(caplog.handler)
    monkeypatch.setattr(logger, "level", logging.INFO)
    monkeypatch.setattr(logger, "propagate", False)  # caplog's handler on the root logger would count them twice
    yield caplog
    logger.removeHandler(caplog.handler)


@pytest.fixture
def two_saved(tmp_path):
    """Checkpoints of steps 5 and 6 under tmp_path (step 6 the latest), and the model as saved at step 6."""
    model, opt = trained()
    partita.save(model, opt, tmp_path, step=5)
    latest = Path(partita.save(model, opt, tmp_path, step=6))
    return tmp_path, latest, model


def overwrite_a_weight(checkpoint: Path, model, value: float = 1e30) -> Path:
    """Put `value` in place of the first float of the model's embedding in the data file that holds it; the file
    keeps its length. Returns the data file."""
    data = checkpoint / "__0_0.distcp"
    content = bytearray(data.read_bytes())
    at = content.find(model.emb.weight.detach().numpy().tobytes())
    assert at > 0
    content[at:at + 4] = struct.pack("<f", value)
    size = data.stat().st_size
    data.write_bytes(bytes(content))
    assert data.stat().st_size == size
    return data


def test_every_file_has_its_checksum_in_the_manifest(two_saved):
    _, latest, _ = two_saved
    recorded = json.loads((latest / "manifest.json").read_text())["checksums"]
    files = sorted(p.name for p in latest.iterdir() if p.name != "manifest.json")
    assert sorted(recorded) == files == [".metadata", "__0_0.distcp"]
    for name, digest in recorded.items():
        assert digest == "xxh3_64:" + xxhash.xxh3_64_hexdigest((latest / name).read_bytes()), name


def test_a_value_changed_in_place_is_refused_and_the_previous_checkpoint_offered(two_saved, tmp_path):
    root, latest, model = two_saved
    overwrite_a_weight(latest, model)
    expected = (rf"{re.escape(str(latest))} is damaged: its file __0_0\.distcp changed after it was saved \(checksum "
                rf"xxh3_64:[0-9a-f]{{16}}, the manifest recorded xxh3_64:[0-9a-f]{{16}}\), so its values cannot be trusted\. Load the "
                rf"previous checkpoint instead: {re.escape(str(root / 'step-000005'))}")
    fresh, opt = trained(seed=7)
    before = {n: t.clone() for n, t in fresh.state_dict().items()}
    with pytest.raises(CheckpointError, match=expected):
        partita.load(fresh, opt, root)
    for name, value in before.items():  # refused before anything was read
        assert torch.equal(fresh.state_dict()[name], value), name
    with pytest.raises(CheckpointError, match=expected):
        export(root, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()
    assert partita.load(fresh, opt, root / "step-000005").step == 5  # the one offered loads


def test_without_xxhash_checkpoints_get_crc32_and_are_checked_all_the_same(two_saved, tmp_path, monkeypatch):
    """Machines that cannot install packages (the lent GPU machines) record crc32; a checkpoint that records
    xxh3_64 is then refused with what to install, not loaded unverified."""
    root, latest, _ = two_saved
    monkeypatch.setattr(checksums, "xxhash", None)
    monkeypatch.setattr(checksums, "ALGORITHM", "crc32")
    with pytest.raises(CheckpointError, match="no xxhash package to compute them: pip install xxhash"):
        partita.load(trained(seed=7)[0], None, latest)
    model, opt = trained()
    saved = Path(partita.save(model, opt, tmp_path / "crc", step=1))
    recorded = json.loads((saved / "manifest.json").read_text())["checksums"]
    for name, digest in recorded.items():
        assert digest == f"crc32:{zlib.crc32((saved / name).read_bytes()):08x}", name
    overwrite_a_weight(saved, model)
    with pytest.raises(CheckpointError, match=r"its file __0_0\.distcp changed after it was saved \(checksum "
                                                      r"crc32:[0-9a-f]{8}, the manifest recorded crc32:"):
        partita.load(model, opt, saved)


def test_partita_export_names_the_changed_file(two_saved, tmp_path, capsys):
    root, latest, model = two_saved
    overwrite_a_weight(latest, model)
    assert cli(["export", str(root), str(tmp_path / "out.pt")]) == 2
    assert "its file __0_0.distcp changed after it was saved" in capsys.readouterr().err


def test_the_only_checkpoint_changed_says_there_is_no_earlier_one(tmp_path):
    model, opt = trained()
    path = Path(partita.save(model, opt, tmp_path, step=1))
    overwrite_a_weight(path, model)
    with pytest.raises(CheckpointError, match=rf"cannot be trusted\. There is no earlier checkpoint under "
                                                      rf"{re.escape(str(tmp_path))}"):
        partita.load(model, opt, tmp_path)


def test_a_changed_metadata_file_is_refused(two_saved):
    root, latest, _ = two_saved
    metadata = latest / ".metadata"
    content = bytearray(metadata.read_bytes())
    at = content.find(b"__0_0.distcp")
    content[at + 4] = ord("1")  # the data file's name becomes that of another existing file's, length unchanged
    shutil.copy(latest / "__0_0.distcp", latest / "__0_1.distcp")
    metadata.write_bytes(bytes(content))
    with pytest.raises(CheckpointError, match=r"its file \.metadata changed after it was saved"):
        partita.load(trained()[0], None, latest)


def test_checkpoints_without_checksums_are_refused_unless_allowed_and_then_say_so_once(two_saved, partita_log,
                                                                                        monkeypatch):
    root, latest, model = two_saved
    for path in (latest, root / "step-000005"):
        manifest = json.loads((path / "manifest.json").read_text())
        del manifest["checksums"]
        (path / "manifest.json").write_text(json.dumps(manifest))
    fresh, opt = trained(seed=7)
    with pytest.raises(CheckpointError, match=f"{latest} has no checksums in its manifest.json.*load it unverified "
                                              "with PARTITA_UNVERIFIED_CHECKPOINTS=on"):
        partita.load(fresh, opt, root)
    monkeypatch.setenv("PARTITA_UNVERIFIED_CHECKPOINTS", "on")
    assert partita.load(fresh, opt, root).step == 6
    assert partita.load(fresh, opt, root / "step-000005").step == 5
    unverified = [r.getMessage() for r in partita_log.records if "checksum" in r.getMessage()]
    assert len(unverified) == 1 and str(latest) in unverified[0], unverified
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name


def test_elastic_resumes_from_the_newest_checkpoint_that_verifies_and_keeps_the_other(tmp_path, partita_log):
    """In one process (the multi-process job is in tests/launch/test_elastic_fallback.py)."""
    model, opt = trained()
    for step in (2, 4, 6):
        partita.save(model, opt, tmp_path, step=step)
    damaged = overwrite_a_weight(tmp_path / "step-000006", model).read_bytes()
    job = partita.elastic(model, opt, tmp_path, save_every=2)
    assert job.step == 4 and job.resumed_from.path == str(tmp_path / "step-000004")
    aside = list(tmp_path.glob("step-000006.skipped-*"))
    assert len(aside) == 1 and (aside[0] / "__0_0.distcp").read_bytes() == damaged
    said = "\n".join(r.getMessage() for r in partita_log.records)
    assert f"cannot resume from {tmp_path / 'step-000006'} (" in said and "changed after it was saved" in said, said
    assert f"kept {tmp_path / 'step-000006'}, which could not be resumed from, as {aside[0]}" in said, said
    for _ in job.steps(8):  # saves steps 6 and 8 (keep=3): the one set aside is neither replaced nor counted
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([JOB_LOCK, "latest", aside[0].name, "step-000004",
                                                                 "step-000006", "step-000008"])
    assert (aside[0] / "__0_0.distcp").read_bytes() == damaged


def test_elastic_with_no_checkpoint_that_loads_changes_nothing(tmp_path):
    model, opt = trained()
    for step in (2, 4):
        overwrite_a_weight(Path(partita.save(model, opt, tmp_path, step=step)), model)
    before = sorted(p.name for p in tmp_path.iterdir())
    expected = (rf"partita\.elastic\(path='{re.escape(str(tmp_path))}'\): none of its 2 checkpoint\(s\) can be resumed "
                r"from, so the job stops \(nothing was renamed or deleted\): .*step-000004: .*step-000002: ")
    with pytest.raises(CheckpointError, match=expected):
        partita.elastic(model, opt, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


# ---- malformed .metadata -------------------------------------------------------------------------------------

def _first_storage(metadata):
    return next(iter(metadata.storage_data.values()))


def _first_tensor(metadata):
    return metadata.state_dict_metadata["model.emb.weight"]


def _set(get, attribute, value):
    def change(metadata):
        get(metadata).__dict__[attribute] = value
    return change


def _delete(get, attribute):
    def change(metadata):
        del get(metadata).__dict__[attribute]
    return change


def _replace_index_name(metadata):
    index, info = next(iter(metadata.storage_data.items()))
    del metadata.storage_data[index]
    metadata.storage_data[MetadataIndex(7)] = info


def _drop_storage_of(metadata):
    del metadata.storage_data[MetadataIndex("model.emb.weight", [0, 0])]


MALFORMED = {
    "file-path-not-a-string": (_set(_first_storage, "relative_path", 7), r"file path 7"),
    "file-path-a-list": (_set(_first_storage, "relative_path", ["__0_0.distcp"]), r"file path \['__0_0\.distcp'\]"),
    "offset-a-string": (_set(_first_storage, "offset", "0"), r"offset '0'"),
    "negative-length": (_set(_first_storage, "length", -5), r"length -5"),
    "no-file-path": (_delete(_first_storage, "relative_path"), r"no file path"),
    "storage-a-list": (_set(lambda m: m, "storage_data", ["x"]), r"storage_data \['x'\]"),
    "no-items": (_delete(lambda m: m, "state_dict_metadata"), r"no state_dict_metadata"),
    "item-a-string": (lambda m: m.state_dict_metadata.__setitem__("model.emb.weight", "x"), r"'model\.emb\.weight'"),
    "size-a-list": (_set(_first_tensor, "size", [50, "16"]), r"size \[50, '16'\]"),
    "negative-size": (_set(_first_tensor, "size", torch.Size([50, -16])), r"size torch\.Size\(\[50, -16\]\)"),
    "dtype-a-string": (_set(lambda m: _first_tensor(m).properties, "dtype", "float32"), r"dtype 'float32'"),
    "chunk-none": (_set(_first_tensor, "chunks", [None]), r"chunk None"),
    "chunk-outside": (lambda m: _first_tensor(m).chunks[0].__dict__.__setitem__("sizes", torch.Size([99, 16])),
                      r"chunk .* outside"),
    "index-name-not-a-string": (_replace_index_name, r"named 7"),
    "no-storage-for-a-chunk": (_drop_storage_of, r"'model\.emb\.weight'.* no storage"),
}


@pytest.mark.parametrize("change,detail", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_metadata_is_a_checkpoint_error_naming_the_file(two_saved, tmp_path, change, detail):
    _, latest, _ = two_saved
    with open(latest / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # written by the test's own save: trusted
    change(metadata)
    (latest / ".metadata").write_bytes(pickle.dumps(metadata, protocol=4))
    expected = rf"{re.escape(str(latest / '.metadata'))} is malformed: .*{detail}"
    fresh, opt = trained(seed=7)
    with pytest.raises(CheckpointError, match=expected):
        partita.load(fresh, opt, latest)
    with pytest.raises(CheckpointError, match=expected):
        export(latest, tmp_path / "out.pt")


@pytest.mark.parametrize("field,value", [("saved_at", "yesterday"), ("checksums", {"__0_0.distcp": 12345}),
                                         ("tensors", {"emb.weight": {"shape": 50, "dtype": "float32"}}),
                                         ("step", None)])
def test_malformed_manifest_is_a_checkpoint_error_naming_the_file(two_saved, field, value):
    root, latest, _ = two_saved
    manifest = json.loads((latest / "manifest.json").read_text())
    manifest[field] = value
    (latest / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(latest / 'manifest.json'))} is not a "
                                                      rf"readable partita manifest \(.*{field}"):
        partita.load(trained()[0], None, latest)
    (root / "latest").unlink()
    assert partita.latest_checkpoint(root) == str(root / "step-000005")  # a malformed manifest is never the latest


# ---- torch's advice to turn weights_only off is not partita's ------------------------------------------------

class RunsShell:
    """Unpickling this runs a shell command: what a malicious checkpoint would carry."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_refused_item_says_what_and_why_without_inviting_to_turn_the_protection_off(two_saved, tmp_path,
                                                                                        monkeypatch):
    monkeypatch.setenv("PARTITA_UNVERIFIED_CHECKPOINTS", "on")  # the forger's checkpoint passes the checksums' check
    root, latest, model = two_saved
    marker = tmp_path / "pwned"
    forged = root / "step-000007"
    items = {f"model.{n}": t for n, t in model.state_dict().items()}
    items.update(step=RunsShell(f"touch {marker}"), extra="{}")
    dcp.save(items, storage_writer=dcp.FileSystemWriter(forged), no_dist=True,
             planner=dcp.DefaultSavePlanner(flatten_state_dict=False))
    manifest = json.loads((latest / "manifest.json").read_text())
    del manifest["checksums"]  # a forger who knows the format leaves no checksum to contradict the files
    (forged / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError) as caught:
        partita.load(CASES["tied_embedding"].make(), None, forged)
    message = str(caught.value)
    assert not marker.exists()
    assert "refused to load the checkpoint's item 'step'" in message
    assert "Trying to load unsupported GLOBAL posix.system" in message  # torch's reason stays
    assert "never runs code from one" in message
    for advice in ADVICE:
        assert advice not in message, message


class Opaque:
    """A module's extra state that only pickled code can rebuild."""


class WithOpaqueState(torch.nn.Linear):
    def get_extra_state(self):
        return Opaque()

    def set_extra_state(self, state):
        pass


def test_saving_a_value_that_needs_pickled_code_says_why_without_torchs_advice(tmp_path):
    with pytest.raises(CheckpointError) as caught:
        partita.save(WithOpaqueState(2, 2), None, tmp_path, step=1)
    message = str(caught.value)
    assert "holds a value that loads only by running pickled code" in message
    assert re.search(r"Unsupported global: GLOBAL \S*Opaque", message), message
    for advice in ADVICE:
        assert advice not in message, message


class ScaledModel(torch.nn.Module):
    """Stands in for a partita model computing in float16 before its first call (`checkpoint.holding.Partitioned`)."""

    plan = None

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module
        self.loaded = "nothing"

    def held(self):
        return None

    def loss_scale_state(self):
        return None

    def load_loss_scale_state(self, state):
        self.loaded = state

    def resume_from(self, checkpoint):
        raise AssertionError("a model on the CPU reads its weights at once")


def forge_with_loss_scale(root: Path, latest: Path, model, value) -> Path:
    """A checkpoint of `model` at step 7 holding `value` as float16's loss scale (and no checksums)."""
    forged = root / "step-000007"
    shutil.rmtree(forged, ignore_errors=True)
    items = {f"model.{n}": t for n, t in model.state_dict().items()}
    items.update(step=7, extra="{}", loss_scale=value)
    dcp.save(items, storage_writer=dcp.FileSystemWriter(forged), no_dist=True,
             planner=dcp.DefaultSavePlanner(flatten_state_dict=False))
    manifest = json.loads((latest / "manifest.json").read_text())
    del manifest["checksums"]
    (forged / "manifest.json").write_text(json.dumps(manifest))
    return forged


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("value", [{"scale": -1.0, "clean_steps": 0}, {"scale": 8.0, "clean_steps": 2000},
                                   {"scale": float("inf"), "clean_steps": 0}, {"scale": 8.0}, [8.0, 0]])
def test_a_malformed_loss_scale_is_a_checkpoint_error(two_saved, value, monkeypatch):
    monkeypatch.setenv("PARTITA_UNVERIFIED_CHECKPOINTS", "on")  # the forged checkpoint has no checksums
    root, latest, model = two_saved
    scaled = ScaledModel(CASES["tied_embedding"].make())
    with pytest.raises(CheckpointError, match="is malformed: its 'loss_scale' is .*, not a float16 loss scale"):
        partita.load(scaled, None, forge_with_loss_scale(root, latest, model, value))
    assert scaled.loaded == "nothing"
    good = {"scale": 8.0, "clean_steps": 3}
    assert partita.load(scaled, None, forge_with_loss_scale(root, latest, model, good)).step == 7
    assert scaled.loaded == good


@pytest.mark.parametrize("kind", ["device", "fifo"])
def test_a_manifest_naming_a_file_that_never_ends_is_refused_at_once(two_saved, kind):
    """checksums naming /dev/zero (outside the checkpoint) or a FIFO in it: load and export used to read forever."""
    root, latest, _ = two_saved
    manifest = json.loads((latest / "manifest.json").read_text())
    if kind == "device":
        manifest["checksums"]["/dev/zero"] = "xxh3_64:0000000000000000"
        expected = "checksums name /dev/zero, which is not a file of the checkpoint"
    else:
        os.mkfifo(latest / "queue")
        manifest["checksums"]["queue"] = "xxh3_64:0000000000000000"
        expected = "records a checksum of queue, which is not one of its files"
    (latest / "manifest.json").write_text(json.dumps(manifest))
    for attempt in (lambda: partita.load(trained()[0], None, latest), lambda: export(latest, root / "out.pt")):
        with pytest.raises(CheckpointError, match=expected):
            attempt()


def test_a_data_file_that_is_not_a_regular_file_is_refused_at_once(two_saved):
    """A link to a device in place of a file the checksums name: its checksum would never end."""
    _, latest, _ = two_saved
    (latest / ".metadata").rename(latest / "metadata.saved")
    os.symlink("/dev/zero", latest / ".metadata")
    with pytest.raises(CheckpointError, match=r"its \.metadata is not a regular file"):
        checksums.verify(latest, read_manifest(latest), [".metadata"])



def test_a_metadata_fifo_is_refused_at_once_also_unverified(two_saved):
    """Read without checksums (PARTITA_UNVERIFIED_CHECKPOINTS=on), a FIFO in place of .metadata would block the
    read forever."""
    _, latest, _ = two_saved
    (latest / ".metadata").unlink()
    os.mkfifo(latest / ".metadata")
    with pytest.raises(CheckpointError, match=r"\.metadata is not a regular file"):
        read_metadata(latest)
