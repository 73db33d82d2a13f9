"""A benchmark's JSON record: its name and date first, then its fields, written under results/."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any


def write_record(path: Path, benchmark: str, **fields: Any) -> dict[str, Any]:
    """Write {"benchmark", "date" (UTC, seconds), **fields} as indented JSON to ``path``
    (parents made) and say where; returns the record."""
    record = {"benchmark": benchmark, "date": datetime.now(UTC).isoformat(timespec="seconds")}
    record.update(fields)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")
    return record
