"""The one request type: ``GenerationRequest`` built from an OpenAI body at the door, turned into
one ``DynamicJob`` per choice on the replica, and "the model's EOS plus these strings" as a stop
condition (``MODEL_EOS``)."""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys

import pytest

from deployments.protocol import OpenAIError, parse_fields, parse_settings
from engine.job import MODEL_EOS, DynamicJob
from engine.request import MAX_CHOICES, GenerationRequest, SamplerSettings


def test_request_defaults_and_choices() -> None:
    request = GenerationRequest(prompt_ids=[5, 6, 7], max_new_tokens=8, n=3, seed=10)
    assert request.prompt_ids == (5, 6, 7) and request.settings == SamplerSettings()
    assert [request.choice_seed(i) for i in range(3)] == [10, 11, 12]
    assert request.choice_id(0) == request.request_id
    assert request.choice_id(2) == f"{request.request_id}/2"
    assert GenerationRequest(prompt_ids=(1,), max_new_tokens=1).choice_seed(3) is None
    assert pickle.loads(pickle.dumps(request)) == request  # it crosses Ray as is
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.n = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt_ids": []}, "prompt_ids is empty"),
        ({"prompt_ids": "hello"}, "prompt_ids must be a sequence of token ids"),
        ({"prompt_ids": [1, -2]}, "prompt_ids holds -2"),
        ({"prompt_ids": [1, True]}, "prompt_ids holds True"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1, got 0"),
        ({"min_new_tokens": 9}, "min_new_tokens 9 exceeds max_new_tokens 4"),
        ({"n": 0}, "n must be >= 1, got 0"),
        ({"n": MAX_CHOICES + 1}, f"n must be <= {MAX_CHOICES}"),
        ({"seed": 1.5}, "seed must be an int, got 1.5"),
        ({"stop_strings": ["ok", ""]}, "stop string '' is not a non-empty string"),
        ({"stop_strings": "stop"}, "stop_strings must be a sequence of strings"),
        ({"settings": {"temperature": 0}}, "settings must be a SamplerSettings"),
        ({"stop_on_eos": 1}, "stop_on_eos must be a bool, got 1"),
        ({"request_id": ""}, "request_id must be a non-empty string"),
    ],
)
def test_request_refuses_bad_values(kwargs: dict, message: str) -> None:
    values = {"prompt_ids": [1, 2], "max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        GenerationRequest(**values)


def test_job_from_request_takes_each_choices_seed_and_stops() -> None:
    settings = SamplerSettings(temperature=0.5, token_bias={3: 1.0})
    request = GenerationRequest(
        prompt_ids=(1, 2, 3),
        max_new_tokens=6,
        min_new_tokens=2,
        settings=settings,
        seed=7,
        n=2,
        stop_strings=("\n\n",),
    )
    job = DynamicJob.from_request(request, 1, return_probs=True)
    assert job.input_ids == [1, 2, 3] and job.max_new_tokens == 6 and job.min_new_tokens == 2
    assert (job.seed, job.identifier) == (8, f"{request.request_id}/1")
    assert job.stop_strings == ("\n\n",) and job.uses_default_stops and job.return_probs
    assert job.gen_settings == settings and job.gen_settings is not settings
    with pytest.raises(ValueError, match="choice 2 is outside the request's n=2"):
        DynamicJob.from_request(request, 2)
    ignoring = GenerationRequest(prompt_ids=(1,), max_new_tokens=2, stop_on_eos=False)
    assert not DynamicJob.from_request(ignoring).uses_default_stops


def test_model_eos_combines_with_stop_strings_and_tokens() -> None:
    class FakeTokenizer:
        def detokenizer(self, *args):
            return None

    job = DynamicJob([1, 2], 4, stop_conditions=[MODEL_EOS, 9, "END"])
    job.bind(0, FakeTokenizer(), default_stop_tokens=[2, 3])
    assert job.stop_tokens == {2, 3, 9} and job.stop_strings == ("END",)
    plain = DynamicJob([1, 2], 4, stop_conditions=[9, "END"])
    plain.bind(1, FakeTokenizer(), default_stop_tokens=[2, 3])
    assert plain.stop_tokens == {9}
    default = DynamicJob([1, 2], 4)
    default.bind(2, FakeTokenizer(), default_stop_tokens=[2, 3])
    assert default.stop_tokens == {2, 3} and default.stop_strings == ()


# -- the OpenAI body -> the request ------------------------------------------------------------


def test_absent_fields_keep_the_engines_defaults() -> None:
    assert parse_settings({}, vocab_size=100) == SamplerSettings()
    fields = parse_fields({"prompt": "x"}, chat=False, vocab_size=100)
    request = fields.generation([1, 2], max_new_tokens=5, page_hashes=[11])
    assert request.settings == SamplerSettings() and request.n == 1 and request.seed is None
    assert request.stop_on_eos and request.stop_strings == () and request.page_hashes == (11,)


def test_body_fields_reach_the_request() -> None:
    body = {
        "temperature": 0,
        "top_p": 0.9,
        "top_k": -1,
        "min_p": 0.05,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.1,
        "logit_bias": {"4": -100},
        "seed": 3,
        "stop": ["a", "", "b"],
        "n": 2,
        "ignore_eos": True,
        "min_tokens": 50,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    fields = parse_fields(body, chat=True, vocab_size=100)
    assert fields.stream and fields.include_usage
    request = fields.generation([1], max_new_tokens=10, page_hashes=[])
    assert request.settings == SamplerSettings(
        temperature=0.0,
        top_p=0.9,
        top_k=0,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        token_bias={4: -100.0},
    )
    assert (request.seed, request.n, request.stop_strings) == (3, 2, ("a", "b"))
    assert not request.stop_on_eos
    assert request.min_new_tokens == 10  # min_tokens is capped by the room left


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"temperature": 3}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"n": MAX_CHOICES + 1}, "n"),
        ({"logit_bias": {"100": 1}}, "logit_bias"),
        ({"stop": [1]}, "stop"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"stream_options": []}, "stream_options"),
    ],
)
def test_bad_fields_are_openai_errors(body: dict, param: str) -> None:
    with pytest.raises(OpenAIError) as raised:
        parse_fields(body, chat=False, vocab_size=100)
    assert raised.value.param == param and raised.value.status == 400


def test_front_end_modules_do_not_import_torch() -> None:
    """The request type, the preset and the router's policy load without torch."""
    code = (
        "import sys, engine.request, engine.cache.prefix_hash, deployments.protocol, "
        "deployments.prefix_index, deployments.preset; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -- cache_salt: tenant isolation of the prefix cache ----------------------------------------


def test_salted_page_hashes_never_meet_other_salts() -> None:
    from engine.cache.prefix_hash import prefix_hashes, salt_root

    ids = list(range(64))
    plain = prefix_hashes(ids, 16)
    alice = prefix_hashes(ids, 16, parent=salt_root("alice"))
    bob = prefix_hashes(ids, 16, parent=salt_root("bob"))
    assert prefix_hashes(ids, 16, parent=salt_root(None)) == plain
    assert prefix_hashes(ids, 16, parent=salt_root("alice")) == alice
    assert not set(alice) & set(bob) and not set(alice) & set(plain)


def test_cache_salt_field() -> None:
    fields = parse_fields({"cache_salt": "tenant-7"}, chat=False, vocab_size=100)
    assert fields.generation([1], 4, []).cache_salt == "tenant-7"
    assert parse_fields({}, chat=False, vocab_size=100).cache_salt is None
    for bad in ("", "x" * 257, 5, "\ud800"):
        with pytest.raises(OpenAIError) as raised:
            parse_fields({"cache_salt": bad}, chat=False, vocab_size=100)
        assert raised.value.param == "cache_salt"


def test_the_steady_sample_request_is_built_once_and_follows_the_job() -> None:
    """Past min_new_tokens with nothing banned a job's request is the same object each step
    (built once); stop tokens before min_new_tokens, a rollback's bans, drafts ahead and a
    rebuilt sequence each give a fresh, correct request."""
    job = DynamicJob([1, 2, 3], 20, stop_conditions=[9], min_new_tokens=2)
    first = job.sample_request()
    assert tuple(first.banned_tokens) == (9,)  # before min_new_tokens: the stop token banned
    job.new_token_ids.extend([4, 5])
    steady = job.sample_request()
    assert steady.banned_tokens == () and steady is not first
    job.new_token_ids.append(6)
    assert job.sample_request() is steady
    ahead = job.sample_request(ahead=(7,))
    assert ahead is not steady and ahead.key is None
    job._bans[3] = {8}  # a rollback banned token 8 at the next position
    banned = job.sample_request()
    assert banned is not steady and 8 in banned.banned_tokens
    job._bans.clear()
    assert job.sample_request() is steady
    job.gen_settings = SamplerSettings(temperature=0.5)  # replaced settings: a new request
    replaced = job.sample_request()
    assert replaced is not steady and replaced.settings is job.gen_settings
    job.return_probs = True
    assert job.sample_request().return_probs


def test_a_penalised_steady_request_sees_the_sequence_it_was_built_for() -> None:
    settings = SamplerSettings(temperature=0.7, repetition_penalty=1.2)
    job = DynamicJob([1, 2, 3], 20, gen_settings=settings)
    steady = job.sample_request()
    assert steady.context is job.seq.tokens
    job.seq.tokens.append(4)  # the sequence grows in place: the request sees it
    assert job.sample_request() is steady and list(steady.context) == [1, 2, 3, 4]
    job.seq.tokens = [1, 2]  # a rebuilt sequence: a new request on the new list
    rebuilt = job.sample_request()
    assert rebuilt is not steady and rebuilt.context is job.seq.tokens
