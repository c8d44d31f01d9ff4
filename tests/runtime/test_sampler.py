"""The sampler and its settings, against NumPy-computed expectations."""

import math

import numpy as np
import pytest

from llmc.errors import LlmcError
from llmc.runtime.sampler import penalized, sample
from llmc.runtime.sampling_params import SamplingParams

LOGITS = np.log(np.array([0.05, 0.4, 0.3, 0.15, 0.1], np.float32))


def frequencies(params, draws=4000, seed=0):
    rng = np.random.default_rng(seed)
    counts = np.bincount([sample(LOGITS, params, rng) for _ in range(draws)], minlength=LOGITS.size)
    return counts / draws


def test_greedy_is_argmax():
    assert sample(LOGITS, SamplingParams(temperature=0), np.random.default_rng()) == 1


def test_temperature_one_matches_softmax():
    np.testing.assert_allclose(frequencies(SamplingParams(temperature=1.0)),
                               [0.05, 0.4, 0.3, 0.15, 0.1], atol=0.03)


def test_top_k_keeps_only_the_k_best():
    freq = frequencies(SamplingParams(temperature=1.0, top_k=2))
    np.testing.assert_allclose(freq, [0, 0.4 / 0.7, 0.3 / 0.7, 0, 0], atol=0.03)


def test_top_p_keeps_the_smallest_set_reaching_p():
    # 0.4 + 0.3 = 0.7 < 0.75, so the 0.15 token is needed as well.
    freq = frequencies(SamplingParams(temperature=1.0, top_p=0.75))
    np.testing.assert_allclose(freq, [0, 0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0], atol=0.03)


def test_low_temperature_sharpens():
    assert frequencies(SamplingParams(temperature=0.1))[1] > 0.9


def test_same_seed_same_draws():
    params = SamplingParams(temperature=1.0, seed=7)
    a = [sample(LOGITS, params, np.random.default_rng(7)) for _ in range(20)]
    b = [sample(LOGITS, params, np.random.default_rng(7)) for _ in range(20)]
    assert a == b


@pytest.mark.parametrize("field,value,message", [
    ("temperature", -0.5, "temperature must be ≥ 0"),
    ("temperature", math.nan, "temperature must be ≥ 0"),
    ("top_k", -1, "top_k must be an integer ≥ 0"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
    ("top_p", 1.5, r"top_p must be in \(0, 1\]"),
    ("max_new_tokens", 0, "max_new_tokens must be an integer ≥ 1"),
    ("seed", -3, "seed must be a non-negative integer"),
])
def test_invalid_settings_are_rejected(field, value, message):
    with pytest.raises(LlmcError, match=message):
        SamplingParams(**{field: value})


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    # Top probability 0.4: min_p 0.5 keeps tokens ≥ 0.2, i.e. 0.4 and 0.3.
    freq = frequencies(SamplingParams(temperature=1.0, min_p=0.5))
    np.testing.assert_allclose(freq, [0, 0.4 / 0.7, 0.3 / 0.7, 0, 0], atol=0.03)


def test_repetition_penalty_follows_hugging_face():
    logits = np.array([2.0, -1.0, 0.5, 3.0])
    got = penalized(logits, SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1, 1])
    np.testing.assert_allclose(got, [1.0, -2.0, 0.5, 3.0])
    # The penalty flips the greedy choice away from the prompt's token.
    assert sample(np.array([3.0, 2.0]), SamplingParams(repetition_penalty=2.0), np.random.default_rng(),
                  prompt=[0]) == 1


def test_presence_penalty_counts_generated_tokens_once():
    logits = np.array([1.0, 1.0, 1.0])
    got = penalized(logits, SamplingParams(presence_penalty=0.5), prompt=[2], output=[0, 0])
    np.testing.assert_allclose(got, [0.5, 1.0, 1.0])  # the prompt's token is not penalized


@pytest.mark.parametrize("field,value,message", [
    ("min_p", 1.5, r"min_p must be in \[0, 1\]"),
    ("repetition_penalty", 0.0, "repetition_penalty must be > 0"),
    ("presence_penalty", 3.0, r"presence_penalty must be in \[-2, 2\]"),
])
def test_invalid_penalties_are_rejected(field, value, message):
    with pytest.raises(LlmcError, match=message):
        SamplingParams(**{field: value})
