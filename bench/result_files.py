"""Reading result files that ``bench/`` scripts wrote, plain or gzip-compressed.

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
