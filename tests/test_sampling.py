import pytest

from llamabatch import SamplingError, SamplingParams
from llamabatch.engine.native import SamplerChain
from llamabatch.engine.sampling import GreedySampler, build_sampler


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_tokens", -1, "max_tokens must be >= 0"),
        ("prompt_logprobs", 21, "prompt_logprobs must be in [0, 20]"),
        ("temperature", -0.1, "temperature must be >= 0"),
        ("top_k", -1, "top_k must be >= 0"),
        ("top_p", 0.0, "top_p must be in (0, 1]"),
        ("top_p", 1.5, "top_p must be in (0, 1]"),
        ("min_p", 2.0, "min_p must be in [0, 1]"),
        ("repeat_penalty", 0.0, "repeat_penalty must be > 0"),
        ("presence_penalty", 3.0, "presence_penalty must be in [-2, 2]"),
        ("frequency_penalty", -2.5, "frequency_penalty must be in [-2, 2]"),
        ("penalty_last_n", -2, "penalty_last_n must be >= -1"),
        ("seed", -1, "seed must be in"),
        ("stop", ("",), "stop strings must not be empty"),
    ],
)
def test_out_of_range_values_are_rejected_with_their_name(field, value, message):
    with pytest.raises(SamplingError, match=message.replace("(", r"\(").replace("[", r"\[")) as info:
        SamplingParams(**{field: value})
    assert isinstance(info.value, ValueError)


def test_stop_list_becomes_a_tuple():
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")


def test_plain_greedy_needs_no_native_chain():
    assert isinstance(build_sampler(SamplingParams(temperature=0), n_vocab=300, n_ctx=256), GreedySampler)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0, repeat_penalty=1.1), SamplingParams(),
     SamplingParams(repeat_penalty=1.3, top_k=0, top_p=1, min_p=0)],
)
def test_every_other_configuration_builds_a_native_chain(params):
    chain = build_sampler(params, n_vocab=300, n_ctx=256)
    assert isinstance(chain, SamplerChain) and not chain.closed
    chain.close()
    chain.close()  # a second close is a no-op
    assert chain.closed
