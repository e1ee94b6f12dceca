"""A long random search of the store model (``make model-soak``): many sequences, several seeds, in parallel.

Each seed drives :func:`~tests.support.store_model.random_ops` for its share of the examples in a
process of its own; a sequence that breaks the contract is shrunk and printed ready to paste as an
explicit example, with the seed and index that reproduce it. Defaults: MODEL_EXAMPLES (1,000,000)
over MODEL_SEEDS (four seeds from the clock) in MODEL_JOBS processes (the cores).

    make model-soak MODEL_EXAMPLES=200000 MODEL_SEEDS=7,8
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import random
import sys
import tempfile
import time

from tests.support.store_model import fails, random_ops, shrink


def soak(seed: int, examples: int) -> tuple[int, int, float, str | None]:
    """(seed, examples run, seconds, the failure as text or None): stops at the first failure."""
    logging.disable(logging.CRITICAL)  # the exporter's own error lines, for disks the model fills, by the million
    rng = random.Random(seed)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fx-soak-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        for i in range(examples):
            ops, cap = random_ops(rng)
            exc = fails(ops, cap, d)
            if exc is not None:
                small = shrink(ops, cap, d)
                return seed, i + 1, time.monotonic() - t0, (
                    f"seed {seed}, example {i}: {fails(small, cap, d)!r}\n    ops={small!r},\n    cap={cap},"
                )
            if (i + 1) % 50_000 == 0:
                print(f"seed {seed}: {i + 1:,} examples, {time.monotonic() - t0:,.0f} s", flush=True)
    return seed, examples, time.monotonic() - t0, None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=int(os.environ.get("MODEL_EXAMPLES") or 1_000_000))
    p.add_argument("--seeds", default=os.environ.get("MODEL_SEEDS") or "")
    p.add_argument("--jobs", type=int, default=int(os.environ.get("MODEL_JOBS") or os.cpu_count() or 1))
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s] or [time.time_ns() % 2**32 + i for i in range(4)]
    share = -(-args.examples // len(seeds))
    print(f"model soak: {share * len(seeds):,} examples, seeds {seeds}, {args.jobs} processes", flush=True)
    t0 = time.monotonic()
    found = 0
    with multiprocessing.Pool(min(args.jobs, len(seeds))) as pool:
        for seed, n, seconds, failure in pool.starmap(soak, [(s, share) for s in seeds]):
            print(f"seed {seed}: {n:,} examples in {seconds:,.0f} s, {'FAILED' if failure else 'contract held'}")
            if failure:
                found += 1
                print(failure)
    print(f"model soak: {found} failures, {time.monotonic() - t0:,.0f} s")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
