"""The torch sampler: `enginecore.sampling_ref` semantics, batched, on the device.

Per row, in order: the structured-output token bitmask (disallowed tokens
-inf), additive token masks, penalties (repetition, frequency,
presence), then greedy argmax for rows with temperature < 1e-5; other rows
are divided by their temperature, filtered (min-p, top-k with ties kept,
top-p with ties at the cut kept) and drawn by inverse CDF in vocabulary order
with the host-provided uniform `u` (the seeded counter-based draw), so a
seeded request gives the same tokens on either backend and in any batch.
Logprobs are those of the raw logits (top-N, ties by lower id, plus the
sampled token's logprob and rank).

On a CPU with the C kernels (`cpu_kernels/csrc`), log_softmax /
softmax, the top-p cut and the draw are those kernels, each row in a fixed
order: the jax backend's sampler calls the same code, so the two backends'
logprobs and seeded draws are the same bits for the same logits.

Nothing here reads a value back to the host: the runner copies the results
once at the end of the step. Cumulative sums are taken in float64 and rounded
to float32 (the reference accumulates in float32; both are within a few ulps
of the running total, so a draw can only differ when `u` lands that close to
a token boundary).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from enginecore.sampling_batch import SamplingBatch
from enginecore.sampling_ref import GREEDY_EPS
from cpu_kernels import torch_ops


@dataclass
class SamplingTensors:
    """`SamplingBatch` on the device (row count Rp, padded rows greedy)."""

    temperature: torch.Tensor  # [Rp] f32
    top_k: torch.Tensor  # [Rp] i64, 0 = off
    top_p: torch.Tensor  # [Rp] f32
    min_p: torch.Tensor  # [Rp] f32
    uniform: torch.Tensor  # [Rp] f32
    all_greedy: bool
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool
    max_top_k: int
    num_logprobs: int  # -1: no logprobs
    bias: torch.Tensor | None = None  # [Rp, V] f32
    output_counts: torch.Tensor | None = None  # [Rp, V] f32
    prompt_mask: torch.Tensor | None = None  # [Rp, V] bool
    presence: torch.Tensor | None = None  # [Rp] f32
    frequency: torch.Tensor | None = None  # [Rp] f32
    repetition: torch.Tensor | None = None  # [Rp] f32
    token_bitmask: torch.Tensor | None = None  # [Rp, ceil(V / 32)] i32 structured outputs

    @classmethod
    def from_batch(cls, sb: SamplingBatch, device: torch.device, to_device=None,
                   num_rows: int | None = None) -> "SamplingTensors":
        """The first `num_rows` rows (default all) on `device`.

        `to_device(name, array) -> tensor` lets the runner stage copies through pinned memory.
        """
        n = len(sb.temperature) if num_rows is None else num_rows
        copy = to_device or (lambda name, a: torch.from_numpy(np.ascontiguousarray(a)).to(device))
        put = lambda name, a: copy(name, a[:n])  # noqa: E731
        sampling = ~(sb.temperature[:n] < GREEDY_EPS)

        def opt(name):
            a = getattr(sb, name)
            return None if a is None else put(name, a)

        return cls(
            temperature=put("temperature", sb.temperature),
            top_k=put("top_k", sb.top_k.astype(np.int64)),
            top_p=put("top_p", sb.top_p),
            min_p=put("min_p", sb.min_p),
            uniform=put("uniform", sb.uniform),
            all_greedy=sb.all_greedy,
            use_top_k=bool(np.any(sampling & (sb.top_k[:n] > 0))),
            use_top_p=bool(np.any(sampling & (sb.top_p[:n] < 1.0))),
            use_min_p=bool(np.any(sampling & (sb.min_p[:n] > 0.0))),
            max_top_k=int(sb.top_k[:n].max(initial=0)),
            num_logprobs=sb.num_logprobs,
            bias=opt("bias"),
            output_counts=opt("output_counts"),
            prompt_mask=opt("prompt_mask"),
            presence=opt("presence"),
            frequency=opt("frequency"),
            repetition=opt("repetition"),
            token_bitmask=opt("token_bitmask"),
        )


    def rows(self, start: int, end: int) -> "SamplingTensors":
        """Rows [start, end) (the batch-wide flags kept: they only enable work)."""
        return dataclasses.replace(self, **{f.name: t[start:end] for f in dataclasses.fields(self)
                                            if isinstance(t := getattr(self, f.name), torch.Tensor)})


@dataclass
class SamplerOutput:
    sampled: torch.Tensor  # [Rp] i64
    topk_ids: torch.Tensor | None = None  # [Rp, N] i64
    topk_logprobs: torch.Tensor | None = None  # [Rp, N] f32
    sampled_logprobs: torch.Tensor | None = None  # [Rp] f32
    sampled_ranks: torch.Tensor | None = None  # [Rp] i64


def row_sums(x: torch.Tensor) -> torch.Tensor:
    """x [R, V] -> [R, 1], each row summed in the same order whatever R. On a CPU torch sums each of several
    rows on one thread, but splits a lone row (>= 32768 columns) between threads, another order: a request's
    logprobs would then change in the last bits with the batch it shares a step with. A lone row is summed as
    one of two identical rows instead (a second row of reads, no copy)."""
    if x.dim() == 2 and x.shape[0] == 1 and x.device.type == "cpu":
        return x.expand(2, -1).sum(dim=-1, keepdim=True)[:1]
    return x.sum(dim=-1, keepdim=True)


def _row_kernels(x: torch.Tensor):
    """The CPU kernels' library for the sampler's row work on x [R, V] (float32 CPU rows, unit column
    stride), else None (torch's ops)."""
    if x.dim() != 2 or x.shape[1] == 0 or x.stride(1) != 1:
        return None
    return torch_ops.lib_for(x)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise, written as `sampling_ref.log_softmax` (rows of -inf give NaN there too); a row's result does
    not depend on the other rows. On a CPU with the C kernels, `cpu_kernels.log_softmax` (the jax backend's
    custom call runs the same code: the two backends' logprobs are the same bits); else torch's ops
    (`row_sums`)."""
    lib = _row_kernels(x)
    if lib is not None:
        return torch_ops.log_softmax(lib, x)
    m = x.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return x - m - torch.log(row_sums(torch.exp(x - m)))


def softmax(x: torch.Tensor) -> torch.Tensor:
    lib = _row_kernels(x)
    if lib is not None:
        return torch_ops.log_softmax(lib, x, probs=True)
    return torch.exp(log_softmax(x))


def top_n(lp: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """lp [R, V] -> (values [R, n], ids [R, n]): each row's n largest, ties by lower id first (one pass of the
    C kernels on a CPU; a stable descending sort elsewhere)."""
    lib = _row_kernels(lp)
    if lib is not None and n <= lp.shape[1]:
        return torch_ops.top_n(lib, lp, n)
    vals, ids = torch.sort(lp, dim=-1, descending=True, stable=True)  # ties: lower id first
    return vals[:, :n], ids[:, :n]


def _cumsum(p: torch.Tensor) -> torch.Tensor:
    return p.double().cumsum(dim=-1).float()


def apply_token_bitmask(x: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """x [R, V], bitmask [R, ceil(V / 32)] i32 -> disallowed tokens at -inf (sampling_ref.apply_token_bitmask):
    shift-and-mask per word, no host sync, fixed shapes (CUDA-graph friendly)."""
    R, V = x.shape
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).reshape(R, -1)[:, :V].bool()
    return x.masked_fill(~allowed, float("-inf"))


def apply_penalties(x: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    counts, r = st.output_counts, st.repetition[:, None]
    seen = st.prompt_mask | (counts > 0)
    x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    x = x - st.frequency[:, None] * counts
    return x - st.presence[:, None] * (counts > 0).float()


def filter_logits(x: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Temperature-scaled logits [Rp, V] -> the same with dropped tokens at -inf (rows with a filter off pass)."""
    neg_inf = float("-inf")
    if st.use_min_p:
        p = softmax(x)
        x = x.masked_fill(p < st.min_p[:, None] * p.amax(dim=-1, keepdim=True), neg_inf)
    if st.use_top_k:
        top = torch.topk(x, st.max_top_k, dim=-1).values  # [Rp, kmax] descending
        kth = top.gather(1, (st.top_k - 1).clamp(min=0)[:, None])
        kth = kth.masked_fill(st.top_k[:, None] <= 0, neg_inf)
        x = x.masked_fill(x < kth, neg_inf)
    if st.use_top_p:
        p = softmax(x)
        lib = _row_kernels(p)
        if lib is not None:  # the jax backend's cut, bit for bit (torch_ops.top_p_thresholds)
            return x.masked_fill(p < torch_ops.top_p_thresholds(lib, p, st.top_p)[:, None], neg_inf)
        ps = torch.sort(p, dim=-1, descending=True).values
        cum = _cumsum(ps)
        # first index where the sorted mass reaches top_p (np.searchsorted side="left")
        cut = (cum < st.top_p[:, None]).sum(dim=-1, keepdim=True).clamp(max=x.shape[-1] - 1)
        drop = (p < ps.gather(1, cut)) & (st.top_p[:, None] < 1.0)
        x = x.masked_fill(drop, neg_inf)
    return x


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [Rp, V], u [Rp] -> [Rp] i64: the first token whose cumulative mass exceeds u * total."""
    lib = _row_kernels(probs)
    if lib is not None:
        return torch_ops.inverse_cdf(lib, probs, u)
    cum = _cumsum(probs)
    target = (u * cum[:, -1])[:, None].contiguous()
    idx = torch.searchsorted(cum, target, right=True)[:, 0]
    V = probs.shape[-1]
    last_nonzero = V - 1 - (probs > 0).flip(-1).int().argmax(dim=-1)
    return torch.where(idx >= V, last_nonzero, idx)


def argmax_rows(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """x [R, V] -> [R] i64: the first index of each row's maximum (torch.argmax's result), in two passes over
    blocks of `block` columns: on a CPU, block maxima vectorize where a full-row argmax does not. The columns
    past the last whole block are one more (shorter) block, reduced in place: nothing is copied but the winning
    block of each row."""
    R, V = x.shape
    if V <= block or x.device.type != "cpu":
        return x.argmax(dim=-1)
    nb, tail = divmod(V, block)
    full = nb * block
    maxima = x[:, :full].reshape(R, nb, block).amax(dim=-1)  # a view: the row stride is kept
    if tail:
        maxima = torch.cat([maxima, x[:, full:].amax(dim=-1, keepdim=True)], dim=1)
    start = maxima.argmax(dim=-1) * block  # first block holding the maximum
    # the winning block's columns; the tail block's window repeats column V - 1, which cannot win over itself
    cols = (start[:, None] + torch.arange(block, device=x.device)).clamp_(max=V - 1)
    return start + x.gather(1, cols).argmax(dim=-1)


def sample_in_chunks(compute_logits, hidden: torch.Tensor, st: SamplingTensors, chunk: int | None) -> SamplerOutput:
    """LM head + `sample` over `chunk` rows of `hidden` [R, H] at a time (all at once when chunk is None).
    (Plain greedy rows can skip the logits: the runner's `_sample`.)

    On a CPU a [rows, V] logits tensor past glibc's mmap threshold is a fresh mapping every step whose
    first touch page-faults, which made 256 x 49152 float32 logits much slower in one piece than in 64-row pieces.
    """
    R = hidden.shape[0]
    if chunk is None or R <= chunk:
        return sample(compute_logits(hidden), st)
    parts = [sample(compute_logits(hidden[i : i + chunk]), st.rows(i, i + chunk)) for i in range(0, R, chunk)]
    cat = lambda name: None if getattr(parts[0], name) is None else torch.cat([getattr(p, name) for p in parts])  # noqa: E731
    return SamplerOutput(**{f.name: cat(f.name) for f in dataclasses.fields(SamplerOutput)})


def sample(logits: torch.Tensor, st: SamplingTensors) -> SamplerOutput:
    """logits [Rp, V] float32 (raw) -> sampled tokens and, if asked for, logprobs."""
    x = logits
    if st.token_bitmask is not None:
        x = apply_token_bitmask(x, st.token_bitmask)
    if st.bias is not None:
        x = x + st.bias
    if st.output_counts is not None:
        x = apply_penalties(x, st)
    greedy_tokens = argmax_rows(x)
    if st.all_greedy:
        sampled = greedy_tokens
    else:
        greedy = st.temperature < GREEDY_EPS
        temp = torch.where(greedy, torch.ones_like(st.temperature), st.temperature)
        x = x / temp[:, None]
        if st.use_top_k or st.use_top_p or st.use_min_p:
            x = filter_logits(x, st)
        drawn = inverse_cdf(softmax(x), st.uniform)
        sampled = torch.where(greedy, greedy_tokens, drawn)
    out = SamplerOutput(sampled=sampled)
    if st.num_logprobs >= 0:
        lp = log_softmax(logits)
        out.topk_logprobs, out.topk_ids = top_n(lp, st.num_logprobs)
        out.sampled_logprobs = lp.gather(1, sampled[:, None])[:, 0]
        out.sampled_ranks = (lp > out.sampled_logprobs[:, None]).sum(dim=-1) + 1
    return out
