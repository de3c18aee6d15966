"""What an ``Idempotency-Key`` costs the manager on its own: the claim and the answer of one key in the state
directory (a ``FileKeys`` create, then a replace; each written to a file and fsynced), on this disk.

    python bench/idempotency_keys.py [--pairs 300] [--folder DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpumgr.manager.control.idempotency import FileKeys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=300, help="keys claimed and answered")
    parser.add_argument("--folder", help="where the keys go (default: a new folder under the system's temp)")
    args = parser.parse_args(argv)
    book = FileKeys(Path(args.folder or tempfile.mkdtemp(prefix="gpumgr-keys-")) / "idempotency")
    claim = {"state": "in_progress", "fingerprint": "f" * 64, "record": "r" * 16, "started": 0.0, "expires": 1e12}
    answer = {"state": "done", "status": 201, "body": {"id": "r" * 16, "pad": "x" * 1500}}  # a record's size
    times = []
    for _ in range(args.pairs):
        t0 = time.perf_counter()
        entry = book.create(uuid.uuid4().hex, claim)
        if entry is None or book.replace(entry, {**claim, **answer}) is None:
            raise RuntimeError("a fresh key could not be claimed and answered")
        times.append(time.perf_counter() - t0)
    times.sort()
    print(f"claim + answer: median {statistics.median(times) * 1000:.2f} ms, "
          f"p90 {times[int(len(times) * 0.9)] * 1000:.2f} ms over {len(times)} keys")
    return 0


if __name__ == "__main__":
    sys.exit(main())
