"""Token ids and log-probabilities over HTTP, at a real vocabulary (65,536), with the official
``openai`` client against a live prefill node (TP 1) and decode node (TP 2): a chunk per
generated token, OpenAI-shaped ``logprobs`` on both endpoints, vLLM's ``return_token_ids`` and
``return_tokens_as_token_ids``, and the same ids and log-probs through the Python client."""

from __future__ import annotations

import math

import pytest

from statebridge.config import HttpConfig, NodeConfig
from statebridge.models.checkpoint import make_checkpoint
from statebridge.models.sampling import MAX_LOGPROBS
from statebridge.node.client import Client
from statebridge.node.text import TextTokenizer

from tests.connector._helpers import wait_until

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess]

VOCAB = 65536
PAGES = 8
PROMPT = "The old man rowed down the river"
MESSAGES = [{"role": "user", "content": "How many days are there in a week?"}]


class Served:
    def __init__(self, model, node):
        self.model, self.node = model, node
        self.tok = TextTokenizer.from_dir(model)
        self.url, self.name = node.http.url, node.http.model_name

    def client(self) -> "openai.OpenAI":
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0,
                             timeout=60)

    def idle(self) -> bool:
        co = self.node.stats()["coordinator"]
        return co["pages_used"] == 0 and co["blocks_used"] == 0


@pytest.fixture(scope="module")
def served(live_pair, tmp_path_factory):
    model = str(make_checkpoint("lfm2-hybrid", tmp_path_factory.mktemp("vocab") / "lfm2h-64k",
                                overrides={"vocab_size": VOCAB}))
    with live_pair(model, num_pages=PAGES, kv_blocks=64, max_prompt_len=64, max_new_tokens=64,
                   node=NodeConfig(front_door="on"), http=HttpConfig(port=0)) as (_, node):
        yield Served(model, node)


def _check_top(chosen: int, chosen_lp: float, top: list[tuple[int, float]], k: int,
               greedy: bool) -> None:
    """One greedy token's log-probs: k top tokens, most likely first, all <= 0, their
    probabilities summing to at most 1, the first of them the token itself."""
    assert len(top) == k
    values = [lp for _, lp in top]
    assert values == sorted(values, reverse=True)
    assert all(lp <= 0 for lp in values) and chosen_lp <= 0
    assert sum(math.exp(lp) for lp in values) <= 1 + 1e-5
    if greedy:
        assert top[0][0] == chosen and top[0][1] == chosen_lp


def test_vocabulary_is_real_sized(served):
    assert served.tok.vocab_size == VOCAB


def test_completion_logprobs_and_token_ids_match_the_python_client(served):
    ids = served.tok.encode(PROMPT)
    with Client(served.node.address) as c:
        gen = c.generate(ids, max_new_tokens=12, logprobs=4)
    assert len(gen.tokens) == len(gen.logprobs) == len(gen.top_logprobs) == 12
    for token, lp, top in zip(gen.tokens, gen.logprobs, gen.top_logprobs):
        _check_top(token, lp, top, 4, greedy=True)

    out = served.client().completions.create(
        model=served.name, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=4,
        extra_body={"return_token_ids": True, "ignore_eos": True})
    (choice,) = out.choices
    assert choice.prompt_token_ids == ids
    assert choice.token_ids == gen.tokens
    assert out.usage.completion_tokens == 12
    lp = choice.logprobs
    assert lp.token_logprobs == pytest.approx(gen.logprobs, abs=1e-6)
    assert lp.tokens == [served.tok.token_text(t) for t in gen.tokens]
    assert len(lp.top_logprobs) == 12
    for tops, (token, chosen_lp), top in zip(lp.top_logprobs, zip(gen.tokens, gen.logprobs),
                                            gen.top_logprobs):
        # The top tokens and the sampled one, by their text.
        expected = {served.tok.token_text(t): v for t, v in reversed(top)}
        expected[served.tok.token_text(token)] = chosen_lp
        assert tops == pytest.approx(expected, abs=1e-6)
    # Where each token's text starts in the choice's text.
    assert lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    assert all(o <= len(choice.text) for o in lp.text_offset)
    assert served.idle()


def test_a_stream_sends_one_chunk_per_token_with_its_ids(served):
    ids = served.tok.encode(PROMPT)
    full = served.client().completions.create(
        model=served.name, prompt=PROMPT, max_tokens=16, temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0]
    chunks = list(served.client().completions.create(
        model=served.name, prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
        logprobs=2, stream_options={"include_usage": True},
        extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True,
                    "ignore_eos": True}))
    usage = chunks[-1].usage
    token_chunks = [c for c in chunks if c.choices]
    assert len(token_chunks) == usage.completion_tokens == 16
    assert token_chunks[0].choices[0].prompt_token_ids == ids
    assert all(getattr(c.choices[0], "prompt_token_ids", None) is None
               for c in token_chunks[1:])
    streamed = [t for c in token_chunks for t in c.choices[0].token_ids]
    assert streamed == full.token_ids
    named = [t for c in token_chunks for t in c.choices[0].logprobs.tokens]
    assert named == [f"token_id:{t}" for t in full.token_ids]
    assert "".join(c.choices[0].text for c in token_chunks) == full.text
    assert [c.choices[0].finish_reason for c in token_chunks] == [None] * 15 + ["length"]


def test_chat_logprobs_and_token_ids(served):
    prompt_ids = served.tok.encode(served.tok.apply_chat_template(MESSAGES))
    out = served.client().chat.completions.create(
        model=served.name, messages=MESSAGES, max_tokens=10, temperature=0, logprobs=True,
        top_logprobs=3, extra_body={"return_token_ids": True, "ignore_eos": True})
    (choice,) = out.choices
    assert out.prompt_token_ids == prompt_ids
    with Client(served.node.address) as c:
        gen = c.generate(prompt_ids, max_new_tokens=10, logprobs=3)
    assert choice.token_ids == gen.tokens
    content = choice.logprobs.content
    assert len(content) == out.usage.completion_tokens == 10
    for item, token, chosen_lp, top in zip(content, gen.tokens, gen.logprobs,
                                           gen.top_logprobs):
        assert item.token == served.tok.token_text(token)
        assert item.bytes == list(item.token.encode("utf-8"))
        assert item.logprob == pytest.approx(chosen_lp, abs=1e-6)
        got = [(t.token, t.logprob) for t in item.top_logprobs]
        assert [name for name, _ in got] == [served.tok.token_text(t) for t, _ in top]
        assert [v for _, v in got] == pytest.approx([v for _, v in top], abs=1e-6)
        _check_top(token, chosen_lp, top, 3, greedy=True)

    # Streamed: the role chunk names the prompt's ids, then one chunk per token.
    chunks = list(served.client().chat.completions.create(
        model=served.name, messages=MESSAGES, max_tokens=10, temperature=0, stream=True,
        logprobs=True, extra_body={"return_token_ids": True, "ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].prompt_token_ids == prompt_ids
    tokens = chunks[1:]
    assert len(tokens) == 10
    assert [t for c in tokens for t in c.choices[0].token_ids] == gen.tokens
    assert [e.logprob for c in tokens for e in c.choices[0].logprobs.content] == \
        pytest.approx(gen.logprobs, abs=1e-6)
    assert all(e.top_logprobs == [] for c in tokens for e in c.choices[0].logprobs.content)
    assert served.idle()


def test_sampled_tokens_get_raw_logprobs(served):
    """At temperature 1 the log-probs are the model's raw ones: the sampled token's is at
    most the top-1's, and the same seed gives the same values."""
    kwargs = dict(model=served.name, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=5,
                  logprobs=MAX_LOGPROBS, extra_body={"return_token_ids": True})
    a = served.client().completions.create(**kwargs).choices[0]
    b = served.client().completions.create(**kwargs).choices[0]
    assert a.token_ids == b.token_ids and a.logprobs.token_logprobs == b.logprobs.token_logprobs
    for chosen_lp, tops in zip(a.logprobs.token_logprobs, a.logprobs.top_logprobs):
        assert chosen_lp <= max(tops.values()) + 1e-6
        assert MAX_LOGPROBS <= len(tops) <= MAX_LOGPROBS + 1


@pytest.mark.parametrize("kwargs, param", [
    (dict(prompt=PROMPT, logprobs=MAX_LOGPROBS + 1), "logprobs"),
    (dict(prompt=PROMPT, logprobs=-1), "logprobs"),
    (dict(prompt=PROMPT, extra_body={"return_token_ids": "yes"}), "return_token_ids"),
], ids=["over-the-cap", "negative", "not-a-boolean"])
def test_bad_logprobs_are_400_naming_the_value(served, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        served.client().completions.create(model=served.name, max_tokens=2, **kwargs)
    assert info.value.body["param"] == param
    if "logprobs" in kwargs:
        assert str(kwargs["logprobs"]) in info.value.body["message"]


def test_bad_chat_logprobs_are_400(served):
    client = served.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=served.name, messages=MESSAGES, max_tokens=2,
                                       logprobs=True, top_logprobs=MAX_LOGPROBS + 1)
    assert info.value.body["param"] == "top_logprobs"
    assert str(MAX_LOGPROBS + 1) in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=served.name, messages=MESSAGES, max_tokens=2,
                                       top_logprobs=2)
    assert info.value.body["param"] == "top_logprobs"
    wait_until(served.idle, 10, "nothing held after refusals")


def test_the_zmq_door_refuses_logprobs_over_the_cap_naming_them(served):
    from statebridge.errors import InvalidRequestError

    with Client(served.node.address) as c:
        with pytest.raises(InvalidRequestError, match=str(MAX_LOGPROBS + 1)):
            c.generate(served.tok.encode(PROMPT), max_new_tokens=2, logprobs=MAX_LOGPROBS + 1)
        plain = c.generate(served.tok.encode(PROMPT), max_new_tokens=2)
    assert plain.logprobs == [] and plain.top_logprobs == []       # not asked: none computed
