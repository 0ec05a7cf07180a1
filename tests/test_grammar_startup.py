"""The grammar vocabulary's build at start-up, over HTTP (issue 22): it starts with the server, a constrained request
that arrives before it is done waits for it (off the event loop and the device thread), an unconstrained one never
waits. The build is gated by an Event the test opens, so the order is the test's, not the machine's speed."""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx

from server.app.runtime import build_engine
from server.constraints.vocab import GrammarVocab, VocabLoader
from tests.support.api_fixtures import live_server, null_host, settings
from tests.support.wait import wait_until


def test_a_constrained_request_waits_for_the_vocabulary_and_an_unconstrained_one_does_not() -> None:
    shared = null_host()
    entered, gate = threading.Event(), threading.Event()

    def gated_build() -> GrammarVocab:
        entered.set()
        assert gate.wait(120), "the test never opened the gate"
        vocab = shared.grammar.wait(600)  # the session's real vocabulary (built once, whoever asks first)
        assert vocab is not None
        return vocab

    host = dataclasses.replace(shared, grammar=VocabLoader(gated_build))
    config = settings(lazy_grammar=False)  # the default: the build starts with the server
    with live_server(config, build_engine(host, config), host) as live, ThreadPoolExecutor(1) as pool:
        wait_until(entered.is_set, "the build to start with the server, before any request")
        client = httpx.Client(base_url=live.url, timeout=120)
        constrained = pool.submit(client.post, "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "JSON, please."}], "max_tokens": 8,
            "response_format": {"type": "json_object"}})
        wait_until(lambda: host.grammar.waiting == 1, "the constrained request to park for the build",
                   alive=lambda: not constrained.done())

        # While the build cannot finish, an unconstrained request is served whole: the event loop and the device
        # thread are free, and nothing on its path waits for the vocabulary.
        free = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                          "max_tokens": 4, "temperature": 0})
        assert free.status_code == 200, free.text
        assert free.json()["usage"]["completion_tokens"] == 4
        assert not constrained.done() and host.grammar.waiting == 1
        assert live.engine.admitted == 0  # parked in the API, not holding a place in the engine's queue

        gate.set()
        answer = constrained.result(120)
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        assert choice["message"]["content"].startswith("{")  # the grammar's first token: compact JSON, an object
        assert host.grammar.waiting == 0
        client.close()
