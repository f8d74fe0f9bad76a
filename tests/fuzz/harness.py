"""A small mutation fuzzer: seeded, time-bounded, in-process, independent of FusionNet.

Each round takes a seed input (or an earlier mutant), applies 1-4 byte-level mutations (bit flips,
interesting integers, insertions, deletions, duplicated or spliced ranges, truncation) and calls
the target. The target either returns (the input was accepted), raises one of the target's allowed
error types (a refusal), or raises anything else: a crash, recorded with the input. A call that takes
longer than ``hang_seconds`` is recorded as a hang (it is not interrupted: a decoder that truly loops
for ever makes the test's own timeout fire instead).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

_INTERESTING = [0, 1, 0x7F, 0x80, 0xFF, 0x100, 0x7FFF, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 2**63 - 1, 2**64 - 1]


@dataclass
class FuzzResult:
    name: str
    execs: int = 0
    accepted: int = 0
    refused: int = 0
    crashes: list[tuple[bytes, str]] = field(default_factory=list)
    hangs: list[tuple[bytes, float]] = field(default_factory=list)
    seconds: float = 0.0

    def line(self) -> str:
        return (
            f"{self.name:16s} {self.execs:8d} execs ({self.execs / max(self.seconds, 1e-9):7.0f}/s) "
            f"accepted {self.accepted:6d} refused {self.refused:8d} "
            f"crashes {len(self.crashes)} hangs {len(self.hangs)}"
        )


def mutate(data: bytes, rng: random.Random, pool: Sequence[bytes]) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(8)
        if not buf and op not in (3, 6):
            op = 3
        if op == 0:  # flip a bit
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)
        elif op == 1:  # random byte
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        elif op == 2:  # an interesting integer, big-endian or little-endian, 1-8 bytes
            size = rng.choice((1, 2, 4, 8))
            value = rng.choice(_INTERESTING) & ((1 << (8 * size)) - 1)
            raw = value.to_bytes(size, rng.choice(("big", "little")))
            i = rng.randrange(len(buf) + 1)
            buf[i : i + size] = raw
        elif op == 3:  # insert random bytes
            i = rng.randrange(len(buf) + 1)
            buf[i:i] = rng.randbytes(rng.randint(1, 16))
        elif op == 4:  # delete a range
            i = rng.randrange(len(buf))
            del buf[i : i + rng.randint(1, 32)]
        elif op == 5:  # duplicate a range
            i = rng.randrange(len(buf))
            j = min(len(buf), i + rng.randint(1, 64))
            buf[j:j] = buf[i:j]
        elif op == 6:  # splice with another input
            other = rng.choice(pool) if pool else b""
            if other:
                i, j = rng.randrange(len(buf) + 1), rng.randrange(len(other))
                buf[i:] = other[j:]
        else:  # truncate
            del buf[rng.randrange(len(buf) + 1) :]
    return bytes(buf)


def fuzz(
    name: str,
    target: Callable[[bytes], object],
    seeds: Sequence[bytes],
    allowed: tuple[type[BaseException], ...],
    *,
    seconds: float,
    seed: int = 0,
    hang_seconds: float = 5.0,
    max_pool: int = 512,
) -> FuzzResult:
    """Runs ``target`` on mutants of ``seeds`` for ``seconds``; the seeds themselves run first."""
    rng = random.Random(seed)
    result = FuzzResult(name)
    pool = list(seeds)
    start = time.monotonic()
    queue = list(seeds)
    while True:
        now = time.monotonic()
        if now - start >= seconds and not queue:
            break
        data = queue.pop() if queue else mutate(rng.choice(pool), rng, pool)
        t0 = time.monotonic()
        try:
            target(data)
            result.accepted += 1
            if len(pool) < max_pool and rng.random() < 0.05:
                pool.append(data)  # accepted mutants are good parents
        except allowed:
            result.refused += 1
        except Exception as e:  # anything else is a finding
            result.crashes.append((data, f"{type(e).__name__}: {e}"[:300]))
        elapsed = time.monotonic() - t0
        if elapsed > hang_seconds:
            result.hangs.append((data, elapsed))
        result.execs += 1
    result.seconds = time.monotonic() - start
    return result
