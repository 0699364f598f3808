"""One request's bad value fails that request only: the same checks at every door, in the dtype
the value is used in; a row of a decode step that cannot be served fails alone; a step that
fails as a whole is a server error (``internal``), not a transfer error."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from statebridge.config import ConnectorConfig, HttpConfig, NodeConfig
from statebridge.connector.stats import Counters
from statebridge.errors import (FailureKind, InternalError, ShapeError, error_for, kind_of)
from statebridge.models.checkpoint import make_checkpoint
from statebridge.models.sampling import sampling_problem
from statebridge.node import messages as nm
from statebridge.node.decode_node import DecodeNode, _Gen
from statebridge.node.http import build_app
from statebridge.node.rank_model import ModelRankModel
from statebridge.node.scheduler import DecodeScheduler
from statebridge.node.text import TextTokenizer

from tests.node.test_http import FakeLink

testclient = pytest.importorskip("starlette.testclient")

VOCAB = 8


# -- one rule set, in float32 ---------------------------------------------------------------------
@pytest.mark.parametrize("temperature,top_p,seed,param", [
    (1.0, 1e-300, 0, "top_p"),            # 0 in float32: the sampler's dtype
    (1.0, 7e-46, 0, "top_p"),
    (1.0, 0.0, 0, "top_p"),
    (1.0, 1.5, 0, "top_p"),
    (1.0, float("nan"), 0, "top_p"),
    (float("nan"), 1.0, 0, "temperature"),
    (float("inf"), 1.0, 0, "temperature"),
    (-0.1, 1.0, 0, "temperature"),
    (2.5, 1.0, 0, "temperature"),
    (1.0, 1.0, 1 << 63, "seed"),
    (1.0, 1.0, -(1 << 63) - 1, "seed"),
], ids=lambda v: repr(v))
def test_sampling_values_that_cannot_be_used_are_named(temperature, top_p, seed, param):
    got = sampling_problem(temperature, top_p, seed)
    assert got is not None and got[0] == param, got
    assert param in got[1]


@pytest.mark.parametrize("temperature,top_p,seed", [
    (0.0, 1.0, 0), (2.0, 1.0, -(1 << 63)), (1e-300, 1.0, (1 << 63) - 1), (1.0, 2e-45, 0),
    (0.7, 0.9, 12345)])
def test_sampling_values_that_can_be_used_pass(temperature, top_p, seed):
    assert sampling_problem(temperature, top_p, seed) is None


def _stub_node(**config) -> DecodeNode:
    """A DecodeNode without ranks: what _problem, _on_generate and _on_step_result touch."""
    node = DecodeNode.__new__(DecodeNode)
    node.node_config = NodeConfig(max_prompt_len=16, max_new_tokens=8, **config)
    node.config = ConnectorConfig()
    node.kv = False
    node.vocab_size = VOCAB
    node.counters = Counters()
    node.coordinator = SimpleNamespace(
        steps=[], freed=[],
        group=SimpleNamespace(to_ranks=lambda msg: node.coordinator.steps.append(msg)),
        free=lambda rid: node.coordinator.freed.append(rid) or True,
        status=lambda: (True, ""), start=lambda *a, **k: None)
    node.scheduler = DecodeScheduler(node.coordinator, node.node_config, node.config,
                                     kv=node.kv, counters=node.counters)
    return node


class Inbox:
    def __init__(self):
        self.got: list[nm.GenerateTokens] = []

    def deliver(self, msg):
        self.got.append(msg)


def _request(rid="r", prompt=(1, 2, 3), **kw):
    values = dict(request_id=rid, prompt=tuple(prompt), max_new_tokens=4, temperature=0.5,
                  top_p=0.9, seed=7)
    values.update(kw)
    return nm.GenerateRequest(**values)


@pytest.mark.parametrize("kw,words", [
    (dict(prompt=(1, 2, 999)), ["999", str(VOCAB)]),
    (dict(prompt=(-1, 2)), ["-1", str(VOCAB)]),
    (dict(top_p=1e-300), ["top_p", "float32"]),
    (dict(temperature=float("nan")), ["temperature"]),
    (dict(seed=1 << 63), ["seed"]),
], ids=["token-999", "token-negative", "top_p-float32", "temperature-nan", "seed"])
def test_the_front_door_refuses_what_the_ranks_cannot_use(kw, words):
    node = _stub_node()
    inbox = Inbox()
    node.serve(inbox, _request(**kw))
    (reply,) = inbox.got
    assert reply.done and reply.kind == "invalid_request", reply
    assert all(w in reply.message for w in words), reply.message
    assert node.scheduler.gens == {}


def test_the_http_door_refuses_top_p_that_is_zero_in_float32(tmp_path):
    out = tmp_path / "m"
    make_checkpoint("lfm2", out, preset="tiny")
    link = FakeLink([5, 6])
    app = build_app(link, TextTokenizer.from_dir(out), HttpConfig(port=0), model_name="m",
                    max_prompt_len=32, max_new_tokens=8, max_inflight=4)
    with testclient.TestClient(app) as http:
        r = http.post("/v1/completions", json={"prompt": "Hi", "top_p": 1e-300})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_p", r.text
        r = http.post("/v1/completions", json={"prompt": "Hi", "seed": 1 << 63})
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    assert link.requests == []


# -- the rank's step: rows fail alone -------------------------------------------------------------
class FakeRunner:
    """Logits whose argmax is token + 1; rejects an out-of-vocabulary id for the whole batch,
    as the real model's embedding does."""

    has_attention = False
    vocab_size = VOCAB

    def __init__(self, fail: Exception | None = None):
        self.fail, self.calls = fail, []

    def decode(self, tokens, pages, positions=None, blocks=None):
        self.calls.append((list(tokens), list(pages), tuple(positions)))
        if self.fail is not None:
            raise self.fail
        bad = [t for t in tokens if not 0 <= t < VOCAB]
        if bad:
            raise ShapeError(f"tokens: token id {bad[0]} outside the vocabulary of {VOCAB}")
        logits = torch.full((len(tokens), VOCAB), -10.0)
        for i, t in enumerate(tokens):
            logits[i, (t + 1) % VOCAB] = 10.0
        return logits


def _rank_model(runner, tp_rank=0):
    model = ModelRankModel.__new__(ModelRankModel)
    model.setup = SimpleNamespace(tp_rank=tp_rank)
    model.runner = runner
    return model


def _step(tokens, top_ps=None, temperatures=None):
    n = len(tokens)
    return nm.RankStep(step=3, request_ids=tuple(f"r{i}" for i in range(n)),
                       pages=tuple(range(n)), tokens=tuple(tokens),
                       positions=tuple(10 + i for i in range(n)),
                       temperatures=tuple(temperatures or [0.0] * n),
                       top_ps=tuple(top_ps or [1.0] * n), seeds=tuple(range(n)))


def test_a_bad_row_fails_alone_in_the_rank_step():
    runner = FakeRunner()
    msg = _step([1, 999, 2, 3, 4], top_ps=[1.0, 1.0, 1.0, 0.0, 1.0],
                temperatures=[0.0, 0.0, 0.0, 1.0, 0.0])
    result = _rank_model(runner).step(msg)
    assert result.kind == "" and result.step == 3
    assert runner.calls == [([1, 2, 3, 4], [0, 2, 3, 4], (10, 12, 13, 14))]   # 999 never ran
    assert result.failed_rows == (1, 3)
    assert result.failed_kinds == ("invalid_request", "invalid_request")
    assert "999" in result.failed_messages[0] and "top_p" in result.failed_messages[1]
    assert [result.tokens[i] for i in (0, 2, 4)] == [2, 3, 5]
    assert _rank_model(FakeRunner(), tp_rank=1).step(msg) is None      # only rank 0 answers


def test_a_step_that_fails_as_a_whole_is_internal():
    result = _rank_model(FakeRunner(fail=RuntimeError("boom"))).step(_step([1, 2]))
    assert result.kind == "internal" and "boom" in result.message and result.tokens == ()


def test_internal_is_its_own_kind_and_class():
    assert FailureKind.parse("internal") is FailureKind.INTERNAL
    error = error_for("internal", "step 3 failed", request_id="r1")
    assert isinstance(error, InternalError) and error.request_id == "r1"
    assert kind_of(error) is FailureKind.INTERNAL


@pytest.mark.parametrize("kind,status,retry", [("internal", 500, False)])
def test_internal_is_http_500_without_retry(tmp_path, kind, status, retry):
    out = tmp_path / "m"
    make_checkpoint("lfm2", out, preset="tiny")
    app = build_app(FakeLink([5], kind=kind), TextTokenizer.from_dir(out), HttpConfig(port=0),
                    model_name="m", max_prompt_len=32, max_new_tokens=8, max_inflight=4)
    with testclient.TestClient(app) as http:
        for stream in (False, True):
            r = http.post("/v1/completions", json={"prompt": "Hi", "stream": stream})
            assert r.status_code == status and ("Retry-After" in r.headers) == retry, r.text
            assert r.json()["error"]["type"] == "server_error"
            assert r.json()["error"]["code"] == kind


# -- the node: a failed row finishes its request, the batch goes on -----------------------------
def _running(node, n):
    inboxes = []
    for i in range(n):
        inbox = Inbox()
        gen = _Gen(f"r{i}", inbox, (1, 2, 3), 4, 0.0, 1.0, 0)
        gen.transfer = SimpleNamespace(seconds=0.0, nbytes=0, page=i, blocks=())
        gen.page, gen.next_token = i, 3
        node.scheduler.gens[gen.request_id] = gen
        node.scheduler.running.append(gen)
        inboxes.append(inbox)
    node.scheduler._maybe_step()
    return inboxes


def test_a_failed_row_finishes_only_its_request():
    node = _stub_node()
    inboxes = _running(node, 3)
    (step,) = node.coordinator.steps
    node.scheduler.on_step_result(0, nm.RankStepResult(
        step=step.step, tp_rank=0, tokens=(5, -1, 6), kind="", message="",
        failed_rows=(1,), failed_kinds=("invalid_request",),
        failed_messages=("token id 999 is outside the vocabulary of 8",)))
    assert [m.tokens for m in inboxes[0].got] == [(5,)] and not inboxes[0].got[0].done
    assert [m.tokens for m in inboxes[2].got] == [(6,)]
    (failed,) = inboxes[1].got
    assert failed.done and failed.kind == "invalid_request" and "999" in failed.message
    assert sorted(node.scheduler.gens) == ["r0", "r2"] and node.coordinator.freed == ["r1"]
    assert [g.request_id for g in node.scheduler.running] == ["r0", "r2"]
    assert node.coordinator.steps[-1].request_ids == ("r0", "r2")    # the next step goes on


def test_a_failed_step_is_internal_for_its_batch():
    node = _stub_node()
    inboxes = _running(node, 2)
    (step,) = node.coordinator.steps
    node.scheduler.on_step_result(0, nm.RankStepResult(step=step.step, tp_rank=0, tokens=(),
                                              kind="internal", message="RuntimeError: boom"))
    assert [(m.kind, m.done) for inbox in inboxes for m in inbox.got] == \
        [("internal", True), ("internal", True)]
    assert node.scheduler.gens == {} and node.scheduler.running == []
