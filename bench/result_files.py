"""Reading result files that ``bench/`` scripts wrote, plain or gzip-compressed, and
writing the summaries kept under ``bench/results/``.

Results under ``bench/results/`` are kept gzipped (``*.json.gz``) once they grow past a
few kilobytes, and torch.profiler's Chrome traces are written gzipped too, so every
reader opens both kinds.
"""

from __future__ import annotations

import gzip
import json


def read_json(path: str):
    """The JSON document at ``path``; a name ending in ``.gz`` is read through gzip."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def dumps_rows(doc: dict, rows: str) -> str:
    """``doc`` as JSON with one line per top-level field and one per item of its list
    ``rows`` (``goals.json``'s cells, ``equivalence.json``'s cases): a row's change is
    one line of a diff, and the file stays a fraction of its indented size."""
    fields = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in doc.items() if k != rows]
    items = ",\n".join(f"  {json.dumps(c)}" for c in doc.get(rows, []))
    return "{\n" + ",\n".join(fields + [f' {json.dumps(rows)}: [\n{items}\n ]']) + "\n}\n"
