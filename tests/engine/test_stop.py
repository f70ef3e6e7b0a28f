"""The pure finish check (vLLM semantics) against hand-worked cases."""

from __future__ import annotations

import pytest

from deepinfer_core.engine.stop import StopDecision, check_stop, find_stop_string
from deepinfer_core.sampling.params import SamplingParams

EOS = [2]


def check(params, token, text, new, n_out=5, n_tokens=20, max_model_len=100):
    return check_stop(params, token, n_out, n_tokens, text, new, EOS, max_model_len)


def test_nothing_to_stop_continues():
    assert check(SamplingParams(max_tokens=10), 5, "hello", 2) == StopDecision()


def test_eos_stops_with_no_stop_reason_and_cuts_its_text():
    d = check(SamplingParams(), 2, "abc</s>", 4)
    assert d == StopDecision("stop", None, 3)
    assert check(SamplingParams(include_stop_str_in_output=True), 2, "abc</s>", 4) == StopDecision("stop")
    assert check(SamplingParams(ignore_eos=True, max_tokens=10), 2, "abc", 0) == StopDecision()


def test_stop_token_id_is_the_stop_reason_and_its_text_is_cut():
    p = SamplingParams(stop_token_ids=[9])
    assert check(p, 9, "ab!!", 2) == StopDecision("stop", 9, 2)
    assert check(p, 9, "ab", 0) == StopDecision("stop", 9, None)  # special token: no text


def test_eos_wins_over_a_stop_id_that_is_also_eos():
    assert check(SamplingParams(stop_token_ids=[2]), 2, "x", 0).stop_reason is None


def test_stop_string_cut_before_it_or_kept_with_include():
    p = SamplingParams(stop=["END"])
    # "END" completed by the last 2 chars; the text after it in the same delta is dropped too
    assert check(p, 5, "some textENDmore", 6) == StopDecision("stop", "END", 9)
    q = p.replace(include_stop_str_in_output=True)
    assert check(q, 5, "some textENDmore", 6) == StopDecision("stop", "END", 12)
    assert check(q, 5, "some textEND", 2) == StopDecision("stop", "END", None)  # nothing to cut


def test_stop_string_is_searched_only_where_the_new_text_can_complete_it():
    # "END" lies entirely in old text: it would have been found earlier, so it is not matched now
    assert find_stop_string("xxENDyyyy", 3, ["END"], False) is None
    # spanning old and new text is found
    assert find_stop_string("xxENDy", 2, ["END"], False) == ("END", 2)
    assert find_stop_string("abc", 0, ["c"], False) is None


def test_first_stop_string_in_list_order_wins():
    assert find_stop_string("..ab..cd", 8, ["cd", "ab"], False) == ("cd", 6)


def test_min_tokens_suppresses_stop_conditions_but_not_length_caps():
    p = SamplingParams(min_tokens=4, max_tokens=8, stop=["x"], stop_token_ids=[9])
    assert check(p, 2, "ax", 1, n_out=3) == StopDecision()
    assert check(p, 9, "ax", 1, n_out=3) == StopDecision()
    assert check(p, 5, "ax", 1, n_out=4) == StopDecision("stop", "x", 1)
    assert check(p, 5, "a", 1, n_out=3, n_tokens=50, max_model_len=50) == StopDecision("length")


@pytest.mark.parametrize("n_out,n_tokens,reason", [(8, 20, "length"), (3, 100, "length"), (3, 99, None)])
def test_length_caps(n_out, n_tokens, reason):
    assert check(SamplingParams(max_tokens=8), 5, "a", 1, n_out, n_tokens).finish_reason == reason
