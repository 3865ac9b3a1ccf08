"""`remote_rm` and `llm_judge` against real HTTP servers on 127.0.0.1 that speak OpenRLHF's
remote-RM protocol and OpenAI's chat-completions protocol."""

import asyncio
import contextlib
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from miles.core.contracts.components import Capability
from miles.core.contracts.types import Sample, SampleStatus
from miles.core.registry.plugins import get_plugin_manager
from miles.rewards.configs import LLMJudgeConfig, RemoteRMConfig
from miles.rewards.llm_judge import LLMJudge, parse_score
from miles.rewards.remote_rm import RemoteRewardError, RemoteRM, RetryPolicy
from miles.runtime.rollout.scoring import RewardScorer

FAST = {"backoff_s": 0.01, "backoff_max_s": 0.02}  # retries without slowing the suite


class FakeServer:
    """A loopback JSON server: fails the first `fail_first` requests with `fail_status`, sleeps
    `delay_s` per request, and answers the rest with `answer(path, body)`."""

    def __init__(self, answer: Callable[[str, dict[str, Any]], Any]) -> None:
        self.answer = answer
        self.fail_first, self.fail_status, self.delay_s = 0, 503, 0.0
        self.requests: list[tuple[str, dict[str, Any], dict[str, str]]] = []
        self.in_flight = self.max_in_flight = 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server._lock:
                    server.requests.append((self.path, body, dict(self.headers)))
                    n = len(server.requests)
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    time.sleep(server.delay_s)
                    if n <= server.fail_first:
                        status, reply = server.fail_status, {"error": "overloaded"}
                    else:
                        status, reply = 200, server.answer(self.path, body)
                finally:
                    # Out of flight before the reply goes: the client may send its next request
                    # the moment it has the reply, before this thread runs again.
                    with server._lock:
                        server.in_flight -= 1
                self._send(status, reply)

            def _send(self, status: int, payload: Any) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    self.wfile.write(data)  # fails only when the client timed out and left

            def log_message(self, *args: Any) -> None:  # keep test output quiet
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=5)


def rm_answer(path: str, body: dict[str, Any]) -> dict[str, Any]:
    # serve_rm's reply shape, extra fields included; the score counts "good" in each query.
    rewards = [float(q.count("good")) for q in body["query"]]
    return {"rewards": rewards, "scores": rewards, "extra_logs": {}}


def chat_answer(path: str, body: dict[str, Any]) -> dict[str, Any]:
    # The judge "grades" with the digit the response under judgement ends with.
    user = body["messages"][-1]["content"]
    verdict = re.search(r"Response:\n(.*?)\n", user, re.DOTALL).group(1)
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": body["model"],
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": f"Fine work.\n{verdict}"},
                "finish_reason": "stop",
            }
        ],
    }


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def rm() -> Iterator[FakeServer]:
    server = FakeServer(rm_answer)
    yield server
    server.close()


@pytest.fixture
def judge() -> Iterator[FakeServer]:
    server = FakeServer(chat_answer)
    yield server
    server.close()


def group(n: int) -> tuple[list[str], list[Sample]]:
    samples = [
        Sample(prompt_ids=[1], sample_id=i, metadata={"prompt": f"Q{i}? ", "answer": f"A{i}"})
        for i in range(n)
    ]
    return ["good " * i + "end" for i in range(n)], samples


# ── remote_rm ────────────────────────────────────────────────────────────────────────────────────


def test_remote_rm_sends_one_request_per_group(rm: FakeServer) -> None:
    reward = RemoteRM(RemoteRMConfig(url=f"{rm.url}/get_reward"))
    responses, samples = group(5)
    assert asyncio.run(reward.score_group(responses, samples)) == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert len(rm.requests) == 1
    path, body, _ = rm.requests[0]
    assert path == "/get_reward"
    assert body == {
        "query": [f"Q{i}? " + responses[i] for i in range(5)],
        "prompts": [f"Q{i}? " for i in range(5)],
        "labels": [f"A{i}" for i in range(5)],
    }


def test_remote_rm_chunks_by_batch_size(rm: FakeServer) -> None:
    reward = RemoteRM(RemoteRMConfig(url=rm.url, batch_size=2, label_key=None))
    responses, samples = group(5)
    assert asyncio.run(reward.score_group(responses, samples)) == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert sorted(len(body["query"]) for _, body, _ in rm.requests) == [1, 2, 2]
    assert all(body["labels"] == [None] * len(body["query"]) for _, body, _ in rm.requests)
    # A single sample is a group of one.
    assert asyncio.run(reward("good good", samples[0])) == 2.0


def test_remote_rm_retries_then_succeeds(rm: FakeServer) -> None:
    rm.fail_first = 2
    reward = RemoteRM(RemoteRMConfig(url=rm.url, max_retries=3, **FAST))
    responses, samples = group(3)
    assert asyncio.run(reward.score_group(responses, samples)) == [0.0, 1.0, 2.0]
    assert len(rm.requests) == 3


def test_remote_rm_gives_up_with_a_clear_error(rm: FakeServer) -> None:
    rm.fail_first = 100
    reward = RemoteRM(RemoteRMConfig(url=rm.url, max_retries=2, **FAST))
    with pytest.raises(RemoteRewardError, match=r"failed 3 times \(last: HTTP 503.*max_retries"):
        asyncio.run(reward.score_group(*group(2)))
    assert len(rm.requests) == 3


def test_remote_rm_does_not_retry_client_errors(rm: FakeServer) -> None:
    rm.fail_first, rm.fail_status = 100, 400
    reward = RemoteRM(RemoteRMConfig(url=rm.url, max_retries=5, **FAST))
    with pytest.raises(RemoteRewardError, match=r"HTTP 400.*not retried"):
        asyncio.run(reward.score_group(*group(2)))
    assert len(rm.requests) == 1


def test_remote_rm_times_out(rm: FakeServer) -> None:
    rm.delay_s = 1.0
    reward = RemoteRM(RemoteRMConfig(url=rm.url, request_timeout_s=0.1, max_retries=1, **FAST))
    start = time.monotonic()
    with pytest.raises(RemoteRewardError, match=r"no reply within request_timeout_s=0\.1"):
        asyncio.run(reward.score_group(*group(1)))
    assert time.monotonic() - start < 0.9  # gave up on the time-out, not on the server
    assert len(rm.requests) == 2


def test_remote_rm_unreachable_server() -> None:
    server = FakeServer(rm_answer)
    url = server.url
    server.close()  # nothing listens on the port any more
    reward = RemoteRM(RemoteRMConfig(url=url, max_retries=1, **FAST))
    with pytest.raises(RemoteRewardError, match=r"failed 2 times \(last: ConnectError"):
        asyncio.run(reward.score_group(*group(1)))


def test_remote_rm_rejects_malformed_replies() -> None:
    server = FakeServer(lambda path, body: {"rewards": [1.0]})  # always one score
    try:
        reward = RemoteRM(RemoteRMConfig(url=server.url))
        with pytest.raises(RemoteRewardError, match="returned 1 scores for 3 queries"):
            asyncio.run(reward.score_group(*group(3)))
        other_key = RemoteRM(RemoteRMConfig(url=server.url, score_key="score"))
        with pytest.raises(RemoteRewardError, match="score_key"):
            asyncio.run(other_key.score_group(*group(1)))
    finally:
        server.close()


def test_remote_rm_bearer_token_from_env(rm: FakeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(RemoteRewardError, match="MILES_TEST_RM_KEY"):
        RemoteRM(RemoteRMConfig(url=rm.url, api_key_env="MILES_TEST_RM_KEY"))
    monkeypatch.setenv("MILES_TEST_RM_KEY", "s3cret")
    reward = RemoteRM(RemoteRMConfig(url=rm.url, api_key_env="MILES_TEST_RM_KEY"))
    asyncio.run(reward.score_group(*group(1)))
    assert rm.requests[0][2]["Authorization"] == "Bearer s3cret"


def test_retry_delays_grow_are_capped_and_honour_retry_after() -> None:
    policy = RetryPolicy(timeout_s=1, max_retries=9, backoff_s=1.0, backoff_max_s=8.0)
    for retry, high in [(0, 1.0), (1, 2.0), (2, 4.0), (3, 8.0), (9, 8.0)]:
        delays = [policy.delay(retry) for _ in range(50)]
        assert all(high / 2 <= d <= high for d in delays)
    assert policy.delay(0, retry_after="3") == 3.0
    assert policy.delay(0, retry_after="120") == 8.0
    assert 0.5 <= policy.delay(0, retry_after="Wed, 21 Oct 2015 07:28:00 GMT") <= 1.0


def test_remote_rm_through_the_run_scorer(rm: FakeServer) -> None:
    """The rollout's scorer calls score_group once per group and sets each sample's reward."""

    class Tokenizer:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return " ".join("good" if i == 1 else "x" for i in ids)

    reward = RemoteRM(RemoteRMConfig(url=rm.url))
    # As the run builds it: the spec says the reward scores whole groups.
    groups = get_plugin_manager().get("reward", "remote_rm").spec.has(Capability.SCORES_GROUPS)
    scorer = RewardScorer(
        reward, "remote_rm", Tokenizer(), groups=groups, on_error="mark_failed", timeout_s=5
    )
    samples = [
        Sample(prompt_ids=[0], response_ids=[1] * k, metadata={"prompt": "Q"}) for k in range(3)
    ]
    asyncio.run(scorer.score(samples))
    assert [s.reward for s in samples] == [0.0, 1.0, 2.0]
    assert len(rm.requests) == 1

    rm.fail_first, rm.fail_status = 100, 400
    failed = [Sample(prompt_ids=[0], response_ids=[1], metadata={"prompt": "Q"})]
    asyncio.run(scorer.score(failed))
    assert failed[0].status is SampleStatus.FAILED
    assert "HTTP 400" in failed[0].error


# ── llm_judge ────────────────────────────────────────────────────────────────────────────────────


def judge_config(server: FakeServer, **kw: Any) -> LLMJudgeConfig:
    return LLMJudgeConfig(base_url=f"{server.url}/v1/", model="judge-1", **FAST, **kw)


def judged(n: int, verdicts: list[str]) -> tuple[list[str], list[Sample]]:
    _, samples = group(n)
    return verdicts, samples


def test_llm_judge_speaks_chat_completions(judge: FakeServer) -> None:
    reward = LLMJudge(judge_config(judge, system_prompt="Be fair."))
    responses, samples = judged(3, ["Score: 7", "score = 10", "**Score:** 2.5 / 10"])
    assert asyncio.run(reward.score_group(responses, samples)) == pytest.approx([0.7, 1.0, 0.25])
    assert len(judge.requests) == 3
    assert {path for path, _, _ in judge.requests} == {"/v1/chat/completions"}
    # Requests run concurrently, in any order: find sample 0's.
    (body,) = [b for _, b, _ in judge.requests if "Q0? " in b["messages"][-1]["content"]]
    assert body["model"] == "judge-1"
    assert body["temperature"] == 0.0
    assert body["messages"][0] == {"role": "system", "content": "Be fair."}
    user = body["messages"][1]["content"]
    assert "A0" in user and "Score: 7" in user


def test_llm_judge_score_parsing(judge: FakeServer) -> None:
    reward = LLMJudge(judge_config(judge, prompt_template="{prompt}\nResponse:\n{response}\n"))
    # No "Score:": the last number counts; out-of-scale scores clip to [0, 1].
    responses, samples = judged(3, ["I'd give it 3 of 10 then 4", "Score: 42", "Score: -3"])
    assert asyncio.run(reward.score_group(responses, samples)) == pytest.approx([0.4, 1.0, 0.0])
    with pytest.raises(ValueError, match="no score in the judge's reply"):
        asyncio.run(reward("no verdict", samples[0]))
    lenient = LLMJudge(
        judge_config(judge, prompt_template="{prompt}\nResponse:\n{response}\n", unparsed_score=0.0)
    )
    assert asyncio.run(lenient("no verdict", samples[0])) == 0.0
    pattern = re.compile(r"rating (\d)", re.IGNORECASE)
    assert parse_score("Rating 4, or 9", pattern, 1, 5) == 0.75


def test_llm_judge_bounds_concurrency(judge: FakeServer) -> None:
    judge.delay_s = 0.05
    reward = LLMJudge(judge_config(judge, max_concurrency=2))
    responses, samples = judged(6, [f"Score: {i}" for i in range(6)])
    scores = asyncio.run(reward.score_group(responses, samples))
    assert scores == pytest.approx([i / 10 for i in range(6)])
    assert len(judge.requests) == 6
    assert judge.max_in_flight == 2


def test_llm_judge_retries_and_fails_clearly(judge: FakeServer) -> None:
    judge.fail_first = 1
    reward = LLMJudge(judge_config(judge, max_retries=1))
    assert asyncio.run(reward(("Score: 5"), group(1)[1][0])) == 0.5
    judge.fail_first = 100
    with pytest.raises(RemoteRewardError, match=r"llm_judge: POST .*/v1/chat/completions failed 2"):
        asyncio.run(reward("Score: 5", group(1)[1][0]))


def test_llm_judge_api_key_from_env(judge: FakeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MILES_TEST_JUDGE_KEY", "k-123")
    reward = LLMJudge(judge_config(judge, api_key_env="MILES_TEST_JUDGE_KEY"))
    asyncio.run(reward("Score: 1", group(1)[1][0]))
    assert judge.requests[0][2]["Authorization"] == "Bearer k-123"


def test_llm_judge_rejects_non_chat_replies() -> None:
    server = FakeServer(lambda path, body: {"choices": [{"message": {"content": None}}]})
    try:
        reward = LLMJudge(judge_config(server))
        with pytest.raises(RemoteRewardError, match="no text content"):
            asyncio.run(reward("Score: 1", group(1)[1][0]))
    finally:
        server.close()
