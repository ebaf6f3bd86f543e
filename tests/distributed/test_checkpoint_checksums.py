"""Checksums of a checkpoint written and checked by several ranks, on a real gloo pool (see support/pool.py)."""

from __future__ import annotations

import json

import xxhash

CASE = "support.checkpoint_cases"


def test_each_ranks_files_are_checksummed_and_a_changed_one_stops_every_rank(pools, tmp_path):
    pools.run(2, f"{CASE}:save_steps", "mlp", str(tmp_path), [1, 2], keep=2)
    latest = tmp_path / "step-000002"
    recorded = json.loads((latest / "manifest.json").read_text())["checksums"]
    assert sorted(recorded) == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # both ranks wrote a data file
    for name, digest in recorded.items():
        assert digest == "xxh3_64:" + xxhash.xxh3_64_hexdigest((latest / name).read_bytes()), name

    data = latest / "__1_0.distcp"  # written by rank 1, checked by rank 0 (the ranks share the checking)
    content = bytearray(data.read_bytes())
    content[len(content) // 2] ^= 0xFF
    data.write_bytes(bytes(content))
    results = pools.run(2, f"{CASE}:failures", "damaged", str(tmp_path))
    assert {r["error"] for r in results} == {"CheckpointError"} and results[0] == results[1]
    message = results[0]["message"]
    assert f"{latest} is damaged: its file __1_0.distcp changed after it was saved" in message, message
    assert f"Load the previous checkpoint instead: {tmp_path / 'step-000001'}" in message, message
