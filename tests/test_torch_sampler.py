"""torchengine.sampler against the executable spec, enginecore.sampling_ref."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from enginecore import sampling_ref as ref  # noqa: E402
from enginecore.sampling_batch import SamplingBatch  # noqa: E402
from enginecore.sampling_ref import GREEDY_EPS, seeded_uniform  # noqa: E402
from torchengine import sampler as torch_sampler  # noqa: E402
from torchengine.sampler import SamplingTensors, argmax_rows, sample  # noqa: E402

V = 300


@pytest.fixture(params=["c_kernels", "torch_ops"], autouse=True)
def row_work(request, monkeypatch):
    """Every test twice: the softmaxes, top-p cut and draw on the CPU kernels (where they run), and on torch's
    ops (GPUs, CPUs without AVX2)."""
    if request.param == "torch_ops":
        monkeypatch.setattr(torch_sampler, "_row_kernels", lambda x: None)
    elif torch_sampler.torch_ops.lib() is None:
        pytest.skip("the CPU kernels do not run here")
    return request.param


def make_batch(rng, R, *, temperature, top_k, top_p, min_p, penalties=False, bias=False, num_logprobs=-1):
    temperature = np.asarray(temperature, np.float32)
    top_k, top_p, min_p = np.asarray(top_k, np.int32), np.asarray(top_p, np.float32), np.asarray(min_p, np.float32)
    sb = SamplingBatch(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        uniform=seeded_uniform(np.arange(R) + 7, 0, rng.integers(0, 1000, R)),
        all_greedy=bool(np.all(temperature < GREEDY_EPS)),
        needs_filtering=bool(np.any((top_k > 0) | (top_p < 1) | (min_p > 0))), num_logprobs=num_logprobs,
    )
    if penalties:
        sb.output_counts = rng.integers(0, 3, (R, V)).astype(np.float32) * (rng.random((R, V)) < 0.05)
        sb.prompt_mask = rng.random((R, V)) < 0.05
        sb.presence = rng.uniform(-1, 1, R).astype(np.float32)
        sb.frequency = rng.uniform(-1, 1, R).astype(np.float32)
        sb.repetition = rng.uniform(0.5, 2, R).astype(np.float32)
    if bias:
        b = np.zeros((R, V), np.float32)
        b[:, rng.integers(0, V, 20)] = rng.uniform(-5, 5, 20).astype(np.float32)
        b[rng.random((R, V)) < 0.3] = -np.inf  # disallowed tokens
        sb.bias = b
    return sb


def ref_tokens(logits: np.ndarray, sb: SamplingBatch) -> list[int]:
    out = []
    for i in range(len(logits)):
        kw = {}
        if sb.output_counts is not None:
            kw = dict(output_counts=sb.output_counts[i], prompt_mask=sb.prompt_mask[i], presence=float(sb.presence[i]),
                      frequency=float(sb.frequency[i]), repetition=float(sb.repetition[i]))
        out.append(ref.sample_row(
            logits[i], temperature=float(sb.temperature[i]), top_k=int(sb.top_k[i]), top_p=float(sb.top_p[i]),
            min_p=float(sb.min_p[i]), u=float(sb.uniform[i]), bias=None if sb.bias is None else sb.bias[i], **kw,
        ))
    return out


def run(logits: np.ndarray, sb: SamplingBatch):
    return sample(torch.from_numpy(logits), SamplingTensors.from_batch(sb, torch.device("cpu")))


CASES = {
    "greedy": dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0),
    "temperature": dict(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0),
    "top_k": dict(temperature=1.0, top_k=5, top_p=1.0, min_p=0.0),
    "top_p": dict(temperature=1.3, top_k=0, top_p=0.8, min_p=0.0),
    "min_p": dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.1),
    "all": dict(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("extras", ["plain", "penalties", "bias"])
def test_sampler_matches_reference(case, extras):
    rng = np.random.default_rng(zlib.crc32(f"{case}/{extras}".encode()))
    R = 48
    logits = (rng.standard_normal((R, V)) * 3).astype(np.float32)
    p = CASES[case]
    sb = make_batch(rng, R, **{k: np.full(R, v) for k, v in p.items()},
                    penalties=extras == "penalties", bias=extras == "bias")
    got = run(logits, sb).sampled.numpy().tolist()
    assert got == ref_tokens(logits, sb)


def test_mixed_rows_and_ties():
    """Every row has its own parameters; tied logits test 'ties kept' at the top-k and top-p cuts."""
    rng = np.random.default_rng(0)
    R = 64
    logits = np.round(rng.standard_normal((R, V)) * 2).astype(np.float32)  # many exact ties
    sb = make_batch(
        rng, R,
        temperature=rng.choice([0.0, 0.5, 1.0, 1.5], R),
        top_k=rng.choice([0, 1, 3, 10, V - 1], R),
        top_p=rng.choice([1.0, 0.5, 0.9, 0.99], R),
        min_p=rng.choice([0.0, 0.05, 0.5], R),
    )
    got = run(logits, sb).sampled.numpy().tolist()
    assert got == ref_tokens(logits, sb)


def test_top_k_keeps_ties():
    logits = np.zeros((1, V), np.float32)
    logits[0, [3, 7, 9]] = 5.0  # three tokens tied at the top, top_k=1 must keep all three
    seen = set()
    for u in np.linspace(0.01, 0.99, 25, dtype=np.float32):
        sb = make_batch(np.random.default_rng(0), 1, temperature=[1.0], top_k=[1], top_p=[1.0], min_p=[0.0])
        sb.uniform = np.array([u], np.float32)
        tok = int(run(logits, sb).sampled[0])
        assert tok == ref_tokens(logits, sb)[0]
        seen.add(tok)
    assert seen == {3, 7, 9}


def test_logprobs_raw_topn_and_rank():
    rng = np.random.default_rng(1)
    R, N = 16, 5
    logits = (rng.standard_normal((R, V)) * 3).astype(np.float32)
    logits[0, [10, 11]] = 20.0  # a tie at the top: the lower id comes first
    sb = make_batch(rng, R, temperature=np.full(R, 1.0), top_k=np.full(R, 3), top_p=np.full(R, 1.0),
                    min_p=np.zeros(R), bias=True, num_logprobs=N)
    out = run(logits, sb)
    for i in range(R):
        lp = ref.log_softmax(logits[i])
        ids, vals, rank = ref.topk_logprobs(lp, int(out.sampled[i]), N)
        assert [int(out.sampled[i])] + out.topk_ids[i].tolist() == ids
        np.testing.assert_allclose([float(out.sampled_logprobs[i])] + out.topk_logprobs[i].tolist(), vals, atol=1e-5)
        assert int(out.sampled_ranks[i]) == rank
    assert out.topk_ids[0, :2].tolist() == [10, 11]


def test_seeded_draw_is_batch_independent():
    """Row i's token depends only on its own logits, parameters and u (never on its neighbours)."""
    rng = np.random.default_rng(2)
    R = 12
    logits = (rng.standard_normal((R, V)) * 2).astype(np.float32)
    sb = make_batch(rng, R, temperature=np.full(R, 1.0), top_k=np.full(R, 50), top_p=np.full(R, 0.95),
                    min_p=np.zeros(R))
    batched = run(logits, sb).sampled.numpy()
    for i in (0, 5, 11):
        one = make_batch(rng, 1, temperature=[1.0], top_k=[50], top_p=[0.95], min_p=[0.0])
        one.uniform = sb.uniform[i : i + 1]
        assert int(run(logits[i : i + 1], one).sampled[0]) == batched[i]


@pytest.mark.parametrize("width", [2 * 1024, 2 * 1024 + 1, 3 * 1024 - 1, 2500])
def test_argmax_rows_blocks_and_ties(width):
    """The blocked argmax past one block, with and without a short last block: torch.argmax's answer
    (the first index of the maximum) with ties inside a block, across blocks and in the last block,
    and the greedy token agrees with sampling_ref."""
    rng = np.random.default_rng(width)
    R = 9
    logits = np.round(rng.standard_normal((R, width)) * 2).astype(np.float32)  # many exact ties
    logits[1, [width - 1, width - 2]] = 50.0  # tie inside the last block
    logits[2, [1023, 1024, width - 1]] = 50.0  # tie across a block boundary and into the last block
    logits[3, [width - 1]] = 50.0  # the maximum alone in the last column
    logits[4, :] = -np.inf  # nothing allowed: index 0, as torch.argmax
    logits[5, :] = 3.0  # all tied
    x = torch.from_numpy(logits)
    assert argmax_rows(x).tolist() == x.argmax(dim=-1).tolist()
    assert argmax_rows(x)[1:4].tolist() == [width - 2, 1023, width - 1]
    finite = np.r_[0:4, 5:R]
    sb = make_batch(rng, len(finite), temperature=np.zeros(len(finite)), top_k=np.zeros(len(finite)),
                    top_p=np.ones(len(finite)), min_p=np.zeros(len(finite)))
    got = run(logits[finite], sb).sampled.numpy().tolist()
    assert got == ref_tokens(logits[finite], sb)
