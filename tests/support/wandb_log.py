"""Read the history that wandb wrote to an offline run's `run-<id>.wandb` file.

wandb ships no Python reader for this file, so the tests decode it: a 7-byte header
(":W&B", magic 0xBEE1, version), then LevelDB-log framing (32 KiB blocks; records of
crc32 u32, length u16, type u8; FULL=1, FIRST=2, MIDDLE=3, LAST=4) around serialized
`wandb_internal_pb2.Record` messages.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

_BLOCK = 32 * 1024
_HEADER = struct.Struct("<IHB")
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def runs(output_dir: Path) -> list[Path]:
    """The transaction logs of every wandb run started in this output_dir, oldest first."""
    return sorted(output_dir.glob("wandb/offline-run-*/run-*.wandb"), key=lambda p: p.parent.name)


def records(path: Path):
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb transaction log"
    offset, pending = 7, b""
    while offset + _HEADER.size <= len(data):
        left_in_block = _BLOCK - offset % _BLOCK
        if left_in_block < _HEADER.size:
            offset += left_in_block
            continue
        _, length, kind = _HEADER.unpack_from(data, offset)
        if kind == 0 and length == 0:  # zero padding at the end of the file
            break
        payload = data[offset + _HEADER.size : offset + _HEADER.size + length]
        offset += _HEADER.size + length
        if kind in (_FULL, _FIRST):
            pending = payload
        else:
            pending += payload
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def history(path: Path) -> dict[int, dict]:
    """{step: {key: value}} of every history row in the log."""
    rows: dict[int, dict] = {}
    for record in records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        row = {}
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            if not key.startswith("_"):
                row[key] = json.loads(item.value_json)
        rows.setdefault(record.history.step.num, {}).update(row)
    return rows


def run_ids(path: Path) -> set[str]:
    return {r.run.run_id for r in records(path) if r.WhichOneof("record_type") == "run"}
