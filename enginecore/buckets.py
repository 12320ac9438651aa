"""Padded step shapes: the bounded set of programs XLA compiles and CUDA graphs capture.

A step of T scheduled tokens from R requests is padded to a token bucket
Tp >= T and a request bucket Rp >= R, both powers of two between a platform
minimum (16 tokens / 8 requests on TPU and GPU: tile sizes; 1 / 1 on CPU,
where a padded row costs as much as a real one) and the scheduler's limits.
Every backend asks this module which shapes exist: the JAX runner compiles
them at start-up, the torch runner captures CUDA graphs for the decode ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from enginecore.config import ConfigError


def pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    """Powers of two from lo up to hi; hi itself closes the list if it is not one."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(sorted(set(out)))


def pick_bucket(buckets: tuple[int, ...], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


class StepShape(NamedTuple):
    """A padded step: tokens x requests."""

    tokens: int
    reqs: int


WARMUP_LEVELS = ("none", "decode", "all")


@dataclass(frozen=True)
class Buckets:
    """The token and request ladders of one engine."""

    tokens: tuple[int, ...]  # ascending
    reqs: tuple[int, ...]  # ascending

    @classmethod
    def create(cls, max_num_batched_tokens: int, max_num_seqs: int, min_tokens: int, min_reqs: int) -> "Buckets":
        if min_tokens < 1 or min_reqs < 1:
            raise ConfigError(f"bucket minimums must be at least 1, got {min_tokens} tokens / {min_reqs} requests "
                              "(--min-token-bucket / --min-seq-bucket)")
        return cls(pow2_buckets(min_tokens, max(min_tokens, max_num_batched_tokens)),
                   pow2_buckets(min_reqs, max(min_reqs, max_num_seqs)))

    @property
    def max_tokens(self) -> int:
        return self.tokens[-1]

    @property
    def max_reqs(self) -> int:
        return self.reqs[-1]

    def shape(self, num_tokens: int, num_reqs: int) -> StepShape:
        return StepShape(pick_bucket(self.tokens, num_tokens), pick_bucket(self.reqs, num_reqs))

    def token_buckets(self, level: str = "all") -> tuple[int, ...]:
        """Token buckets a step can land in at a warmup level ("decode": those of pure-decode steps)."""
        if level == "all":
            return self.tokens
        if level == "decode":
            return tuple(sorted({pick_bucket(self.tokens, r) for r in self.reqs}))
        if level == "none":
            return ()
        raise ConfigError(f"warmup level must be one of {', '.join(WARMUP_LEVELS)}; got {level!r}")

    def decode_shapes(self, sizes: list[int] | None = None) -> list[StepShape]:
        """Shapes of pure-decode steps of R requests for R in `sizes` (default: every R), largest first."""
        max_reqs = self.max_reqs
        sizes = list(sizes) if sizes else list(range(1, max_reqs + 1))
        bad = [s for s in sizes if not isinstance(s, int) or not 1 <= s <= max_reqs]
        if bad:
            raise ValueError(f"capture sizes {bad} must be integers in [1, --max-num-seqs={max_reqs}]")
        return sorted({self.shape(min(r, self.max_tokens), r) for r in sizes}, reverse=True)
