"""Test helper: two runs' outputs compared to the bit."""

from __future__ import annotations


def assert_same_outputs(a, b) -> None:
    """RequestOutputs `a` and `b` (lists, pairwise): the same tokens, and where logprobs were asked for, the same
    logprobs of the same tokens, to the bit."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert (x.outputs[0].logprobs is None) == (y.outputs[0].logprobs is None)
        for s, t in zip(x.outputs[0].logprobs or [], y.outputs[0].logprobs or []):
            assert {k: v.logprob for k, v in s.items()} == {k: v.logprob for k, v in t.items()}
