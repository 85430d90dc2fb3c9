"""Where a gateway process spends its CPU under load: py-spy on one gateway against the mock.

Starts the mock and one gateway like ``bench/mock_suite.py``, loads it with wrk, records
it with py-spy (``pip install py-spy``; ``make bench`` installs it) and prints the
functions with the most samples, inclusive and self, plus a collapsed-stack file for a
flame graph (``bench/results/profile-*.txt``; open it in speedscope or flamegraph.pl).

    .venv/bin/python bench/profile_gateway.py --kind json --concurrency 16 --seconds 20
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import tempfile
import threading
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mock_suite import ROOT, retire_mock_model, setup_platform, start_gateway, start_mock, wrk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", default="json", choices=["json", "sse"])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--server", default="uvicorn", choices=["daphne", "uvicorn"])
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--no-tokenizer", action="store_true")
    args = parser.parse_args()
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    workdir = Path(tempfile.mkdtemp(prefix="profile-gateway-"))
    mock = start_mock(workdir, 8)
    gateway = None
    try:
        key = setup_platform(mock.base, tokenizer=not args.no_tokenizer)
        gateway = start_gateway(args.server, workdir, key)
        wrk(gateway, workdir, args.kind, args.concurrency, 3)  # warm up
        out = ROOT / "bench" / "results" / f"profile-{datetime.now(UTC):%Y%m%dT%H%M%S}.txt"
        recorder = subprocess.Popen(
            [py_spy, "record", "--pid", str(gateway.proc.pid), "--rate", "500", "--format", "raw", "--nonblocking",
             "--duration", str(args.seconds), "--output", str(out)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        load = threading.Thread(target=wrk, args=(gateway, workdir, args.kind, args.concurrency, args.seconds + 2))
        load.start()
        recorder.wait()
        load.join()
    finally:
        if gateway is not None:
            gateway.stop()
            retire_mock_model()
        mock.stop()
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in out.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        frames = stack.split(";")
        total += n
        own[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n
    print(f"{total} samples; collapsed stacks in {out}\n\ninclusive:")
    for frame, n in inclusive.most_common(args.top):
        print(f"  {n / total * 100:5.1f} %  {frame}")
    print("\nself:")
    for frame, n in own.most_common(args.top):
        print(f"  {n / total * 100:5.1f} %  {frame}")


if __name__ == "__main__":
    main()
