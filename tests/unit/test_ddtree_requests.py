"""Per-request allowlist of what DDTree serves exactly (vllm_ddtree.config), over the
fields of vLLM's real SamplingParams: exact on a tree, exact without drafts (the
request is decoded without drafts, patch core_ddtree-requests-without-drafts), or
refused."""

import pytest

pytest.importorskip("vllm")
from vllm import SamplingParams  # noqa: E402
from vllm.sampling_params import (  # noqa: E402
    RepetitionDetectionParams,
    RequestOutputKind,
    StructuredOutputsParams,
)

from vllm_ddtree.config import (  # noqa: E402
    TREE_EXACT_REQUEST_FIELDS,
    TREE_REFUSED_REQUEST_FIELDS,
    TREE_WITHOUT_DRAFTS_REQUEST_FIELDS,
    decode_without_drafts,
    sampling_param_fields,
    validate_ddtree_request,
)
from vllm_ddtree.reach_ins import PIN_0_26, installed_pin  # noqa: E402

LISTS = (TREE_EXACT_REQUEST_FIELDS, TREE_WITHOUT_DRAFTS_REQUEST_FIELDS,
         TREE_REFUSED_REQUEST_FIELDS)

FIELDS = sampling_param_fields(SamplingParams)

# A value other than the default for every field: the constructor's keyword, or
# (fields vLLM derives after construction) an attribute set afterwards.
EXACT_VALUES = dict(
    n=3, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, seed=7,
    logit_bias={3: 1.5}, allowed_token_ids=[1, 2, 3], min_tokens=2, max_tokens=5,
    stop=["\n\n"], stop_token_ids=[5], ignore_eos=True, include_stop_str_in_output=True,
    output_text_buffer_length=4, detokenize=False, skip_special_tokens=False,
    spaces_between_special_tokens=False, output_kind=RequestOutputKind.FINAL_ONLY,
    skip_clone=True,
    repetition_detection=RepetitionDetectionParams(max_pattern_size=4, min_count=3),
    skip_reading_prefix_cache=True, flat_logprobs=True, extra_args={"kv_transfer_params": {}},
    logprobs=0, logprob_token_ids=[3, 4], prompt_logprobs=2,
    routed_experts_prompt_start=3, _eos_token_id=2, _all_stop_token_ids={2, 5},
    stream_interval=4, watermarking=True, _watermarking_skipped=True,
)
WITHOUT_DRAFTS_VALUES = dict(
    presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
    bad_words=["foo"], _bad_words_token_ids=[[3]],
    structured_outputs=StructuredOutputsParams(json={"type": "object"}),
)
REFUSED_VALUES = dict(thinking_token_budget=16,
                      prompt_logprob_token_ids=[[3, 4]], prompt_logprob_start=0,
                      trace_decode_token_ids=[3, 4, 5])
# SamplingParams fields of vLLM 0.33.0 that 0.26.0 does not have: classified for the
# 0.33.0 pin, absent (and so untested) on 0.26.0.
ONLY_ON_0_33 = {"stream_interval", "watermarking", "_watermarking_skipped",
                "prompt_logprob_token_ids", "prompt_logprob_start", "trace_decode_token_ids"}
PIN = installed_pin()
if PIN == PIN_0_26:
    for values in (EXACT_VALUES, WITHOUT_DRAFTS_VALUES, REFUSED_VALUES):
        for name in ONLY_ON_0_33:
            values.pop(name, None)


def _params(name, value):
    try:
        return SamplingParams(**{name: value})
    except TypeError:  # not a constructor keyword
        params = SamplingParams()
        setattr(params, name, value)
        return params


def test_every_sampling_param_is_classified():
    """A field that vLLM adds in a new release fails here until it is put in one
    list (and meanwhile is refused unless at its default)."""
    classified = [set(fields) for fields in LISTS]
    unclassified = set(FIELDS).difference(*classified)
    assert not unclassified, f"SamplingParams fields in no list: {sorted(unclassified)}"
    assert sum(len(c) for c in classified) == len(set().union(*classified))  # disjoint
    later = ONLY_ON_0_33 if PIN == PIN_0_26 else set()
    if PIN != PIN_0_26:
        assert ONLY_ON_0_33 <= set(FIELDS)
    stale = set().union(*classified) - set(FIELDS) - later
    assert not stale, f"classified names that SamplingParams does not have: {sorted(stale)}"
    # Every field of this pin has an example value here, so each is tested below.
    assert set(EXACT_VALUES) == set(TREE_EXACT_REQUEST_FIELDS) - later
    assert set(WITHOUT_DRAFTS_VALUES) == set(TREE_WITHOUT_DRAFTS_REQUEST_FIELDS) - later
    assert set(REFUSED_VALUES) == set(TREE_REFUSED_REQUEST_FIELDS) - later


def test_the_fields_are_read_from_the_struct():
    assert "temperature" in FIELDS and "logprob_token_ids" in FIELDS
    assert len(FIELDS) == len(SamplingParams.__struct_fields__)


@pytest.mark.parametrize("name", sorted(EXACT_VALUES))
def test_each_exact_field_passes_with_a_non_default_value(name):
    params = _params(name, EXACT_VALUES[name])
    assert getattr(params, name) != getattr(SamplingParams(), name)
    validate_ddtree_request(params)


@pytest.mark.parametrize("name", sorted(EXACT_VALUES))
def test_an_exact_field_keeps_the_request_on_trees(name):
    assert not decode_without_drafts(_params(name, EXACT_VALUES[name]))


@pytest.mark.parametrize("name", sorted(WITHOUT_DRAFTS_VALUES))
def test_each_without_drafts_field_passes_and_decodes_without_drafts(name):
    params = _params(name, WITHOUT_DRAFTS_VALUES[name])
    assert getattr(params, name) != getattr(SamplingParams(), name)
    validate_ddtree_request(params)
    assert decode_without_drafts(params)


def test_defaults_decode_on_trees():
    assert not decode_without_drafts(SamplingParams())
    assert not decode_without_drafts(SamplingParams(bad_words=[], presence_penalty=0.0,
                                                    repetition_penalty=1.0))
    assert not decode_without_drafts(None)


@pytest.mark.parametrize("name", sorted(REFUSED_VALUES))
def test_each_refused_field_is_refused_by_name(name):
    params = _params(name, REFUSED_VALUES[name])
    with pytest.raises(ValueError, match=rf"support {name} \("):
        validate_ddtree_request(params)


def test_defaults_and_unset_equivalents_pass():
    validate_ddtree_request(SamplingParams())
    # None and [] both mean "no bad words" / "no logprob token ids".
    validate_ddtree_request(SamplingParams(bad_words=[], logprob_token_ids=[]))
    assert not decode_without_drafts(SamplingParams(logprobs=5))
    validate_ddtree_request(SamplingParams(
        temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=7, max_tokens=5,
        min_tokens=2, logit_bias={3: 1.5}, presence_penalty=0.0, repetition_penalty=1.0))


def test_every_refused_field_is_named_in_one_message():
    class NewerSamplingParams(SamplingParams, omit_defaults=True, dict=True):
        new_upstream_knob: int = 0

    params = NewerSamplingParams(new_upstream_knob=1, prompt_logprobs=2,
                                 repetition_penalty=1.1, logprobs=3)
    params.thinking_token_budget = 8
    with pytest.raises(ValueError) as info:
        validate_ddtree_request(params)
    message = str(info.value)
    for name in ("thinking_token_budget (", "new_upstream_knob ("):
        assert name in message
    # Served: prompt logprobs and sample logprobs, penalties without drafts.
    for name in ("repetition_penalty", "logprobs"):
        assert name not in message
    assert "DDTree" in message


def test_a_field_in_neither_list_is_refused_unless_default():
    """Fail closed: a field vLLM adds later is refused with its name until it is
    classified (a subclass of the real SamplingParams with one more field)."""

    class NewerSamplingParams(SamplingParams, omit_defaults=True, dict=True):
        new_upstream_knob: int = 0

    validate_ddtree_request(NewerSamplingParams())
    with pytest.raises(ValueError, match="new_upstream_knob .*does not know yet"):
        validate_ddtree_request(NewerSamplingParams(new_upstream_knob=1))
