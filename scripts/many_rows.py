"""A results folder of many row files, copied and varied from a small real run, to time the report on.

    python -m harness.run -m model=tiny strategy=no_cache,contiguous,int8 batch=1,2 ctx=16,32 \
        decode_tokens=4 calibration_budget_s=1 results_dir=/tmp/tiny
    python scripts/many_rows.py /tmp/tiny /tmp/many 5000
    python -m harness.report results_dir=/tmp/many

Each copy is one of the source's rows with a new point key and timestamp, its context moved to one of
CONTEXTS and its batch to one of BATCHES (step times scaled by the context, so plots and fits have a
shape), written as the runner writes rows (one Parquet file each, named as harness.store.files names
them). The copy's calibration record comes along, so the rows are predicted as the source's were.
"""
from __future__ import annotations

import hashlib
import shutil
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from harness.store.files import row_filename

CONTEXTS = (16, 32, 64, 128, 256, 512, 1024, 2048)  # contexts the copies spread over
BATCHES = (1, 2, 4, 8)  # batches the copies spread over
REPEATS_APART = 1.0  # seconds between two copies' timestamps


def varied(row: dict, index: int) -> dict:
    """Copy `index` of a source row: another point (batch, ctx, key, timestamp), times scaled."""
    ctx = CONTEXTS[index % len(CONTEXTS)]
    batch = BATCHES[(index // len(CONTEXTS)) % len(BATCHES)]
    scale = (1 + ctx / 1024) / (1 + int(row["ctx"]) / 1024)
    out = dict(row, ctx=ctx, batch=batch)
    out["point_key"] = hashlib.sha256(f"{row.get('point_key')}-{index}".encode()).hexdigest()[:16]
    for column, value in row.items():
        if column.startswith("decode_step") and column.endswith("_s") and isinstance(value, float):
            out[column] = value * scale
        elif column == "decode_step_times_s" and value is not None:
            out[column] = [t * scale for t in value]
    if row.get("group_id"):
        out["group_id"] = f"{row['group_id']}-{index // 3}"  # members of a group stay together, three by three
    return out


def write_many(source: Path, target: Path, count: int) -> int:
    """`count` row files in `target`, varied from the rows of `source`; returns the count written."""
    rows = [(pq.read_table(path), path) for path in sorted(source.glob("*.parquet")) if not path.name.startswith((".", "_"))]
    if not rows:
        raise SystemExit(f"{source} holds no row files")
    target.mkdir(parents=True, exist_ok=True)
    for record in source.glob("_calibration*"):
        (shutil.copytree if record.is_dir() else shutil.copy2)(record, target / record.name)
    for index in range(count):
        table, _ = rows[index % len(rows)]
        row = varied(table.to_pylist()[0], index // len(rows))
        out = pa.Table.from_pylist([row], schema=table.schema)
        pq.write_table(out, target / row_filename({**row, "strategy_family": row.get("strategy_family") or row["strategy"]}))
    return count


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    print(f"wrote {write_many(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]))} row files to {sys.argv[2]}")
