"""Per-request refusals of what DDTree cannot honour yet (vllm_ddtree.config)."""

import pytest

pytest.importorskip("vllm")
from vllm import SamplingParams  # noqa: E402

from vllm_ddtree.config import validate_ddtree_request  # noqa: E402


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=7),
        dict(max_tokens=5, min_tokens=2, logit_bias={3: 1.5}),
    ],
)
def test_supported_requests_pass(kwargs):
    validate_ddtree_request(SamplingParams(**kwargs))


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(logprobs=2), "logprobs"),
        (dict(presence_penalty=0.5), "presence_penalty"),
        (dict(frequency_penalty=0.5), "frequency_penalty"),
        (dict(repetition_penalty=1.2), "repetition_penalty"),
    ],
)
def test_unsupported_requests_are_refused_by_name(kwargs, name):
    with pytest.raises(ValueError, match=name):
        validate_ddtree_request(SamplingParams(**kwargs))
