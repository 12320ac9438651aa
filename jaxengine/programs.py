"""The jitted programs of one JAX engine step, and how their inputs are packed.

A step runs two programs (plus a third, rarely):

* ``model`` (one per token bucket Tp): the ragged batch through the decoder,
  KV written into the donated cache, and the hidden state of each request's
  last token gathered into a fixed ``[S, H]`` buffer (S = the largest request
  bucket). Request metadata is padded to ``R(Tp) = min(Tp, S)`` rows (a step
  of Tp tokens has at most that many requests), so the model program depends
  on the token bucket only. Token ids that the previous step sampled and the
  host has not seen yet are read from ``last_tokens`` on the device.
* ``sample`` (per request bucket Rp, sampler variants: greedy, sample, full,
  masked, processed): LM head on the first Rp gathered rows, the sampler, and the sampled
  tokens written into ``last_tokens`` for the next step.
* ``prompt_logprobs`` (rare): log-softmax top-k of given hidden rows.

All of a program's small inputs travel as one int32 array (floats bitcast),
so a step costs two host-to-device copies and one device-to-host copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from enginecore.arch import ArchConfig
from enginecore.sampling_batch import SamplingBatch
from enginecore.step_batch import StepBatch
from enginecore.structured_outputs import bitmask_width
from jaxengine.model import ModelKernels, RaggedMetadata, compute_logits, forward, greedy_tokens
from jaxengine.sampler import log_softmax, no_logprobs, sample


class ProgramKey(NamedTuple):
    """Names one compiled program."""

    kind: str  # "model" | "sample" | "prompt_logprobs"
    size: int  # padded tokens (model), padded requests (sample), hidden rows (prompt_logprobs)
    mode: str = ""  # sample: the sampler variant (jaxengine.sampler.SAMPLER_MODES)

    def describe(self) -> str:
        if self.kind == "model":
            return f"model tokens={self.size}"
        if self.kind == "sample":
            return f"sample reqs={self.size} {self.mode}"
        return f"{self.kind} rows={self.size}"


def _f32_bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.int32)


# ---- the model program ----------------------------------------------------------------------


@dataclass(frozen=True)
class ModelLayout:
    """Offsets of the model program's fields inside its packed int32 input."""

    tokens: int  # Tp
    reqs: int  # R(Tp): request metadata rows
    width: int  # block-table columns

    @property
    def fields(self) -> tuple[tuple[str, int], ...]:
        T, R = self.tokens, self.reqs
        return (("input_ids", T), ("input_from_row", T), ("positions", T), ("kv_lens", R),
                ("cu_q_lens", R + 1), ("distribution", 3), ("logits_indices", R), ("all_rows", 1),
                ("block_tables", R * self.width))

    @property
    def size(self) -> int:
        return sum(n for _, n in self.fields)

    def pack(self, b: StepBatch) -> np.ndarray:
        """The StepBatch's arrays, request metadata padded from Rp to R(Tp) rows."""
        T, R, W = self.tokens, self.reqs, self.width
        Rp, R_real = b.padded_num_reqs, b.num_reqs
        assert b.padded_num_tokens == T and Rp <= R and b.block_tables.shape[1] == W
        out = np.zeros(self.size, np.int32)
        o = 0
        out[o : o + T] = b.input_ids
        o += T
        out[o : o + T] = b.input_from_row
        o += T
        out[o : o + T] = b.positions
        o += T
        out[o : o + Rp] = b.kv_lens
        o += R
        out[o : o + Rp + 1] = b.cu_q_lens
        out[o + Rp + 1 : o + R + 1] = b.num_tokens
        o += R + 1
        out[o : o + 3] = b.distribution
        o += 3
        out[o : o + R_real] = b.logits_indices[:R_real]
        o += R
        out[o] = bool(b.prompt_logprobs)  # every row's hidden state is read (prompt logprobs), not just the sampled
        o += 1
        out[o : o + Rp * W] = b.block_tables.reshape(-1)
        return out

    def unpack(self, packed) -> dict:
        out, o = {}, 0
        for name, n in self.fields:
            out[name] = packed[o : o + n]
            o += n
        return out


def model_step(params, kv_cache, last_tokens, rope, packed, *, layout: ModelLayout, num_rows: int,
               arch: ArchConfig, attention_fn, scan_layers: bool, kernels: ModelKernels = ModelKernels()):
    """-> (hidden [Tp, H] before the final norm, rows [num_rows, H] at logits_indices, kv_cache)."""
    f = layout.unpack(packed)
    src = f["input_from_row"]
    ids = jnp.where(src >= 0, last_tokens[jnp.maximum(src, 0)], f["input_ids"])
    md = RaggedMetadata(f["kv_lens"], f["block_tables"], f["cu_q_lens"], f["distribution"])
    hidden, kv_cache = forward(params, kv_cache, ids, f["positions"], md, rope, arch, attention_fn, kernels,
                               scan_layers=scan_layers, keep=f["logits_indices"], all_rows=f["all_rows"])
    rows = hidden[f["logits_indices"]]
    rows = jnp.pad(rows, ((0, num_rows - layout.reqs), (0, 0)))
    return hidden, rows, kv_cache


# ---- the sample program -------------------------------------------------------------------


@dataclass(frozen=True)
class SampleLayout:
    reqs: int  # Rp

    @property
    def size(self) -> int:
        return 6 * self.reqs + 3

    def pack(self, sb: SamplingBatch, sample_rows: np.ndarray) -> np.ndarray:
        R = self.reqs
        out = np.empty(self.size, np.int32)
        out[0:R] = _f32_bits(sb.temperature)
        out[R : 2 * R] = sb.top_k
        out[2 * R : 3 * R] = _f32_bits(sb.top_p)
        out[3 * R : 4 * R] = _f32_bits(sb.min_p)
        out[4 * R : 5 * R] = _f32_bits(sb.uniform)
        out[5 * R : 6 * R] = sample_rows
        out[6 * R :] = (sb.all_greedy, sb.needs_filtering, sb.num_logprobs >= 0)
        return out

    def unpack(self, packed):
        R = self.reqs
        f32 = lambda a: lax.bitcast_convert_type(a, jnp.float32)  # noqa: E731
        return (f32(packed[0:R]), packed[R : 2 * R], f32(packed[2 * R : 3 * R]), f32(packed[3 * R : 4 * R]),
                f32(packed[4 * R : 5 * R]), packed[5 * R : 6 * R], packed[6 * R :] != 0)


def bitmask_input(sb: SamplingBatch, reqs: int, vocab_size: int) -> np.ndarray:
    """The [Rp, ceil(V / 32)] structured-output bitmask (-1, all allowed, when no row is constrained)."""
    if sb.token_bitmask is not None:
        return sb.token_bitmask
    return np.full((reqs, bitmask_width(vocab_size)), -1, np.int32)


def sampler_inputs(sb: SamplingBatch, mode: str, reqs: int, vocab_size: int) -> tuple[np.ndarray, ...]:
    """The extra inputs of a sampler variant: none; the bitmask ("masked"); processed + bitmask ("processed")."""
    if mode == "masked":
        return (bitmask_input(sb, reqs, vocab_size),)
    if mode == "processed":
        return processed_inputs(sb, reqs, vocab_size) + (bitmask_input(sb, reqs, vocab_size),)
    return ()


def processed_inputs(sb: SamplingBatch, reqs: int, vocab_size: int) -> tuple[np.ndarray, ...]:
    """The [Rp, V] penalty / token-mask arrays (zeros for what no row uses)."""
    z = lambda dt: np.zeros((reqs, vocab_size), dt)  # noqa: E731
    return (
        sb.bias if sb.bias is not None else z(np.float32),
        sb.output_counts if sb.output_counts is not None else z(np.float32),
        sb.prompt_mask if sb.prompt_mask is not None else z(bool),
        sb.presence if sb.presence is not None else np.zeros(reqs, np.float32),
        sb.frequency if sb.frequency is not None else np.zeros(reqs, np.float32),
        sb.repetition if sb.repetition is not None else np.ones(reqs, np.float32),
    )


def sample_step(params, rows, last_tokens, packed, *extra, layout: SampleLayout, arch: ArchConfig,
                mode: str, num_logprobs: int, method: str, chunk_rows: int | None = None,
                kernels: ModelKernels = ModelKernels()):
    """-> (out [Rp, 3 + 2N] i32: sampled, top-N ids, top-N logprobs, sampled logprob, rank; last_tokens).

    `extra`: the variant's inputs (`sampler_inputs`): () | (bitmask,) | (*processed, bitmask).

    `chunk_rows`: run the LM head and the sampler over that many rows at a time (a loop), so the
    [rows, V] logits are never all alive at once. On a CPU a large temporary is a fresh mapping
    whose first touch page-faults, which made 256 rows x 49152 logits much slower in one piece.
    """
    R = layout.reqs
    temperature, top_k, top_p, min_p, uniform, sample_rows, flags = layout.unpack(packed)
    # the rows up to the last that samples: the request bucket's padding past them is not multiplied by the LM
    # head on a CPU (the torch backend computes no padding)
    live = jnp.max(jnp.where(sample_rows >= 0, jnp.arange(1, R + 1, dtype=jnp.int32), 0))

    def head(hidden, per_row, extra, live):
        if mode == "greedy" and (tokens := greedy_tokens(params, hidden, arch, kernels, live)) is not None:
            return tokens, no_logprobs(hidden.shape[0], num_logprobs)  # the LM head's argmax, no logits
        logits = compute_logits(params, hidden, arch, kernels, live)
        processed, bitmask = (extra[:-1] or None, extra[-1]) if extra else (None, None)
        return sample(logits, *per_row, flags[0], flags[1], flags[2], processed, bitmask,
                      mode=mode, num_logprobs=num_logprobs, method=method, cpu_kernels=params.panels is not None)

    per_row = (temperature, top_k, top_p, min_p, uniform)
    if chunk_rows is None or R <= chunk_rows:
        sampled, (ids, lps, tok_lp, rank) = head(rows[:R], per_row, extra, live)
    else:
        n = -(-R // chunk_rows)
        pad = n * chunk_rows - R

        def split(a):
            a = jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1))
            return a.reshape(n, chunk_rows, *a.shape[1:])

        lives = live - jnp.arange(n, dtype=jnp.int32) * chunk_rows  # each chunk's (clamped by the kernels)
        res = lax.map(lambda xs: head(*xs), (split(rows[:R]), tuple(map(split, per_row)), tuple(map(split, extra)),
                                             lives))
        sampled, (ids, lps, tok_lp, rank) = jax.tree.map(lambda a: a.reshape(n * chunk_rows, *a.shape[2:])[:R], res)
    S = last_tokens.shape[0]
    last_tokens = last_tokens.at[jnp.where(sample_rows >= 0, sample_rows, S)].set(sampled, mode="drop")
    bits = lambda a: lax.bitcast_convert_type(a, jnp.int32)  # noqa: E731
    out = jnp.concatenate([sampled[:, None], ids, bits(lps), bits(tok_lp)[:, None], rank[:, None]], axis=1)
    return out, last_tokens


def unpack_sample_output(out: np.ndarray, num_logprobs: int):
    """Host side of `sample_step`'s packed output: (sampled [Rp], ids [Rp, N], logprobs [Rp, N], tok_lp, rank)."""
    N = num_logprobs
    return (out[:, 0], out[:, 1 : 1 + N], out[:, 1 + N : 1 + 2 * N].view(np.float32),
            out[:, 1 + 2 * N].view(np.float32), out[:, 2 + 2 * N])


# ---- prompt logprobs ----------------------------------------------------------------------


def prompt_logprobs_step(params, hidden_rows, targets, *, arch: ArchConfig, k: int,
                         kernels: ModelKernels = ModelKernels()):
    """hidden_rows [n, H], targets [n] -> (target logprob [n], rank [n], top-k ids [n, k], top-k logprobs [n, k])."""
    lp = log_softmax(compute_logits(params, hidden_rows, arch, kernels), cpu_kernels=params.panels is not None)
    tgt = jnp.take_along_axis(lp, targets[:, None], axis=-1)[:, 0]
    rank = jnp.sum(lp > tgt[:, None], axis=-1, dtype=jnp.int32) + 1
    vals, ids = lax.top_k(lp, k)
    return tgt, rank, ids.astype(jnp.int32), vals
