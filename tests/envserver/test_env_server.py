"""The env server on loopback (uvicorn in a thread) with real envs, driven by EnvClient over HTTP and WebSocket."""

import json
import math
import os
import threading
import time
import warnings

import gymnasium as gym
import httpx
import numpy as np
import pytest
import websockets.sync.client
from websockets.sync.client import connect as ws_connect

import chatenv
import chatenv.envserver.sessions
from chatenv.envserver import EnvClient, EnvServer
from chatenv.envserver.sessions import EnvService, env_info
from chatenv.envserver.wire import to_json
from chatenv.errors import APIError
from chatenv.web import MAX_BODY_BYTES

REPLIES = ["<answer>5</answer>", "I think <answer>12</answer>", "The answer is <answer>7</answer>."]
KEY = "secret-key-123"


@pytest.fixture(scope="module")
def servers():
    """One server per env configuration, started when first asked for."""
    started = {}

    def get(env_id, **kwargs):
        key = (env_id, tuple(sorted(kwargs.items())))
        if key not in started:
            started[key] = EnvServer(env_id, **kwargs).start()
        return started[key]

    yield get
    for server in started.values():
        server.stop()


def reply_action(env, text):
    """The action a policy would send for a reply with this content, in ``env``'s input mode."""
    base = env.unwrapped
    if base.input_mode != "tokens":
        return text
    return base.chat_tokenizer.reply(base.messages, {"role": "assistant", "content": text}).ids.numpy()


def same(a, b):
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return a == b


@pytest.mark.parametrize("transport", ["http", "ws"])
@pytest.mark.parametrize("mode", ["tokens", "history", "text"])
def test_round_trip_equals_the_env_in_process(servers, mode, transport):
    server = servers("chatenv/Arithmetic-v0", input_mode=mode)
    local = gym.make("chatenv/Arithmetic-v0", input_mode=mode)
    remote = EnvClient(server.url, "chatenv/Arithmetic-v0", transport=transport)
    try:
        assert remote.observation_space == local.observation_space and remote.action_space == local.action_space
        (obs_l, info_l), (obs_r, info_r) = local.reset(seed=3), remote.reset(seed=3)
        assert same(obs_r, str(obs_l) if mode == "text" else obs_l) and info_r == to_json(info_l)
        for text in REPLIES:
            action = reply_action(local, text)
            out_l, out_r = local.step(action), remote.step(action)
            assert same(out_r[0], str(out_l[0]) if mode == "text" else out_l[0])
            assert out_r[1] == float(out_l[1]) and out_r[2:4] == out_l[2:4]
            assert out_r[4] == to_json(out_l[4])
            if out_l[2] or out_l[3]:
                break
        assert np.array_equal(remote.token_ids, local.unwrapped.token_ids)
        assert remote.messages == local.unwrapped.messages
    finally:
        remote.close()
        local.close()


@pytest.mark.parametrize("transport", ["http", "ws"])
def test_token_env_round_trip(servers, transport):
    server = servers("chatenv/TokenArithmetic-v0")
    local = gym.make("chatenv/TokenArithmetic-v0")
    remote = EnvClient(server.url, transport=transport)
    try:
        assert remote.action_space == gym.spaces.Discrete(local.unwrapped.vocab_size)
        assert same(remote.reset(seed=1)[0], local.reset(seed=1)[0])
        ids = reply_action(gym.make("chatenv/Arithmetic-v0", input_mode="tokens"), "<answer>4</answer>")
        for token in ids.tolist():
            out_l, out_r = local.step(token), remote.step(np.int64(token))
            assert same(out_r[0], out_l[0]) and out_r[1] == float(out_l[1]) and out_r[2:4] == out_l[2:4]
            if out_l[2] or out_l[3]:
                break
        assert out_r[4] == to_json(out_l[4]) and "reward_components" in out_r[4]
    finally:
        remote.close()
        local.close()


def test_websocket_gives_what_http_gives(servers):
    server = servers("chatenv/Arithmetic-v0", input_mode="tokens")
    http, ws = EnvClient(server.url), EnvClient(server.url, transport="ws")
    try:
        assert same(http.reset(seed=7)[0], ws.reset(seed=7)[0])
        for text in REPLIES[:2]:
            action = np.asarray(http.chat_tokenizer.reply(http.messages, {"role": "assistant", "content": text}).ids)
            a, b = http.step(action), ws.step(action)
            assert same(a[0], b[0]) and a[1:] == b[1:]
        assert http.state()["step_count"] == ws.state()["step_count"] == 2
    finally:
        http.close()
        ws.close()


@pytest.mark.parametrize(
    ("env_id", "kwargs", "transport"),
    [
        ("chatenv/Arithmetic-v0", {"input_mode": "tokens"}, "http"),
        ("chatenv/Arithmetic-v0", {"input_mode": "history"}, "ws"),
        ("chatenv/Arithmetic-v0", {"input_mode": "text"}, "ws"),
        ("chatenv/TokenArithmetic-v0", {}, "http"),
        ("chatenv/CalculatorArithmetic-v0", {"input_mode": "history"}, "http"),  # tools: schemas from /info
    ],
)
def test_chatenv_check_passes_through_the_client(servers, env_id, kwargs, transport):
    server = servers(env_id, **kwargs)
    report = chatenv.check(lambda: EnvClient(server.url, transport=transport))
    assert report.ok and len(report.results) == 8


@pytest.mark.parametrize(
    ("env_id", "kwargs"),
    [
        ("chatenv/TokenArithmetic-v0", {}),
        ("chatenv/Arithmetic-v0", {}),
        ("chatenv/Arithmetic-v0", {"input_mode": "tokens"}),
    ],
)
def test_gymnasium_check_env_passes_on_the_client(servers, env_id, kwargs):
    # check_env's random actions are valid chat actions here: a Discrete token id for TokenEnv, random text in history
    # mode, random ids in tokens mode; the render check is skipped (a client has no spec to make render-mode copies
    # from, and check_env warns about that)
    from gymnasium.utils.env_checker import check_env

    client = EnvClient(servers(env_id, **kwargs).url)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            check_env(client, skip_render_check=True)
        assert [str(w.message) for w in caught] == []
    finally:
        client.close()


def test_sessions_are_independent(servers):
    server = servers("chatenv/Arithmetic-v0", input_mode="tokens")
    a, b = EnvClient(server.url), EnvClient(server.url)
    try:
        obs_a, _ = a.reset(seed=0)
        obs_b, _ = b.reset(seed=1)
        before = b.state()
        a.step(np.asarray(a.chat_tokenizer.reply(a.messages, {"role": "assistant", "content": "1"}).ids))
        assert b.state() == before and a.state()["step_count"] == 1
        assert same(b.reset(seed=0)[0], obs_a) and not same(obs_a, obs_b)
        assert a.session_id != b.session_id and {a.session_id, b.session_id} <= set(
            httpx.get(f"{server.url}/sessions").json()["sessions"]
        )
    finally:
        a.close()
        b.close()


def _post(url, path, body, session="raw"):
    return httpx.post(f"{url}{path}", json=body, headers={"X-Session-Id": session})


def test_bad_actions_get_4xx_and_leave_the_env_unchanged(servers):
    server = servers("chatenv/Arithmetic-v0", input_mode="tokens")
    url = server.url
    r = _post(url, "/step", {"action": {"tokens": [1, 2]}}, session="never-reset")
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    obs = _post(url, "/reset", {"seed": 2})
    assert obs.status_code == 200 and obs.headers["X-Session-Id"] == "raw"
    state = httpx.get(f"{url}/state", headers={"X-Session-Id": "raw"}).json()
    vocab = httpx.get(f"{url}/info").json()["vocab_size"]
    bad = [  # an action of the wrong shape is 422 (OpenEnv's validation status), one the env refuses 400
        ({"message": "text"}, 422, "invalid_action"),
        ({"tokens": [vocab]}, 400, "value_error"),
        ({"tokens": []}, 400, "value_error"),
        ({"tokens": 3.5}, 422, "invalid_action"),
        ({"tokens": [1.5]}, 422, "invalid_action"),
        ({"tokens": [1], "token": 1}, 422, "invalid_action"),
        ([1, 2], 422, "invalid_action"),
    ]
    for action, status, code in bad:
        r = _post(url, "/step", {"action": action})
        assert r.status_code == status and r.json()["error"]["code"] == code, (action, r.text)
        assert r.json()["error"]["message"] and r.json()["detail"]
    assert "tokens mode" in _post(url, "/step", {"action": {"message": "hi"}}).json()["detail"][0]["msg"]
    r = _post(url, "/step", {"actions": [1]})
    assert r.status_code == 422 and r.json()["error"]["param"] == "action"
    r = _post(url, "/step", {"action": {"tokens": [1]}, "timeout_s": 5})
    assert r.status_code == 422 and r.json()["error"]["param"] == "timeout_s"
    r = _post(url, "/reset", {"seed": 2, "sead": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sead"
    assert httpx.get(f"{url}/state", headers={"X-Session-Id": "raw"}).json() == state
    # the next valid step gives what a fresh env gives
    local = gym.make("chatenv/Arithmetic-v0", input_mode="tokens")
    local.reset(seed=2)
    action = reply_action(local, "<answer>1</answer>")
    out = _post(url, "/step", {"action": {"tokens": action.tolist()}, "request_id": "r1"}).json()
    expected = local.step(action)
    assert out["observation"] == {"tokens": expected[0].tolist()} and out["reward"] == float(expected[1])
    assert out["request_id"] == "r1"
    # a step after the episode ended: 409
    while not out["done"]:
        out = _post(url, "/step", {"action": {"tokens": action.tolist()}}).json()
    r = _post(url, "/step", {"action": {"tokens": action.tolist()}})
    assert r.status_code == 409 and r.json()["error"]["code"] == "env_state"
    assert httpx.delete(f"{url}/sessions/raw").json() == {"session_id": "raw", "deleted": True}


def test_the_client_raises_what_the_env_raises(servers):
    client = EnvClient(servers("chatenv/Arithmetic-v0", input_mode="tokens").url, transport="ws")
    try:
        with pytest.raises(APIError) as refused:
            client.step([1])
        assert (refused.value.status, refused.value.code) == (404, "session_not_found")
        client.reset(seed=0)
        with pytest.raises(TypeError, match="tokens mode"):
            client.step("hello")
        with pytest.raises(ValueError):
            client.step([10**9])
        fresh = client.fork(episode=False)
        with pytest.raises(RuntimeError, match="reset"):
            fresh.step([1])
        fresh.close()
    finally:
        client.close()
    with pytest.raises(ValueError, match="serves"):
        EnvClient(servers("chatenv/Arithmetic-v0", input_mode="tokens").url, "chatenv/GuessNumber-v0")


def test_openenv_style_requests_without_a_session(servers):
    url = servers("chatenv/Arithmetic-v0", input_mode="history").url
    assert httpx.get(f"{url}/health").json()["status"] == "healthy"
    reset = httpx.post(f"{url}/reset", json={}).json()
    assert reset["done"] is False and reset["reward"] is None and reset["observation"]["messages"][-1]["role"] == "user"
    action = {"message": {"role": "assistant", "content": "<answer>1</answer>"}, "metadata": {}}
    step = httpx.post(f"{url}/step", json={"action": action}).json()
    assert set(step) == {"observation", "reward", "done", "terminated", "truncated", "info"}
    assert step["observation"]["messages"][-2] == action["message"]
    state = httpx.get(f"{url}/state").json()
    assert state["session_id"] == "default" and state["step_count"] == 1 and state["episode_id"] == "default:1"
    assert httpx.delete(f"{url}/session").status_code == 200


def test_the_least_recently_used_session_is_evicted():
    with EnvServer("chatenv/Arithmetic-v0", input_mode="tokens", max_sessions=2) as server:
        a, b, c = (EnvClient(server.url) for _ in range(3))
        a.reset(seed=0)
        b.reset(seed=0)
        a.state()  # a is used more recently than b
        c.reset(seed=0)
        with pytest.raises(APIError, match="max_sessions=2") as evicted:
            b.state()
        assert (evicted.value.status, evicted.value.code) == (409, "session_evicted")
        r = httpx.get(f"{server.url}/state", headers={"X-Session-Id": b.session_id})
        assert r.status_code == 409 and r.json()["error"]["code"] == "session_evicted"
        assert a.state()["step_count"] == 0 and c.state()["step_count"] == 0
        b.reset(seed=0)  # a reset starts it again (evicting a, now the least recently used)
        with pytest.raises(APIError, match="closed to make room"):
            a.state()
        for client in (a, b, c):
            client.close()


def test_an_api_key_is_required_when_given():
    with EnvServer("chatenv/Arithmetic-v0", api_key=KEY) as server:
        assert httpx.get(f"{server.url}/health").status_code == 200
        r = httpx.post(f"{server.url}/reset", json={})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(APIError) as refused:
            EnvClient(server.url)
        assert (refused.value.status, refused.value.code) == (401, "invalid_api_key")
        with pytest.raises(APIError):
            EnvClient(server.url, transport="ws", api_key="wrong-key-456")
        for transport in ("http", "ws"):
            client = EnvClient(server.url, transport=transport, api_key=KEY)
            assert client.reset(seed=0)[0][-1]["role"] == "user"
            client.close()
    with pytest.raises(ValueError, match="API key"):
        EnvServer("chatenv/Arithmetic-v0", host="0.0.0.0")


def test_cli_refuses_bad_arguments(capsys):
    from chatenv.cli import main

    assert main(["serve-env", "chatenv/Arithmetic-v0", "--env-kwargs", "[1]"]) == 2
    assert main(["serve-env", "chatenv/Nope-v0"]) == 2
    assert main(["serve-env", "chatenv/Arithmetic-v0", "--host", "0.0.0.0"]) == 2
    assert main(["serve-env", "chatenv/Arithmetic-v0", "--host", "0.0.0.0", "--no-api-key"]) == 2
    assert main(["serve-env", "chatenv/Arithmetic-v0", "--no-api-key", "--api-key", "secret-key-123"]) == 2
    assert main(["serve-env", "chatenv/Arithmetic-v0", "--max-sessions", "0"]) == 2
    err = capsys.readouterr().err
    assert "JSON object" in err and "unknown env" in err and "API key" in err and "--max-sessions" in err


@pytest.mark.slow
def test_cli_serves_an_env(tmp_path):
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "chatenv.cli", "serve-env", "chatenv/Arithmetic-v0", "--port", str(port)]
    command += ["--env-kwargs", '{"input_mode": "tokens", "max_turns": 2}', "--log-level", "warning"]
    log = tmp_path / "serve-env.log"
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    env.pop("CHATENV_API_KEY", None)
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/health")
                break
            except httpx.HTTPError:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
        # no --api-key: a key made at start, in a file only this user can read; without it, nothing is served
        key_file = tmp_path / "chatenv" / f"serve-env-127.0.0.1-{port}.key"
        key = key_file.read_text().strip()
        assert key not in log.read_text() and str(key_file) in log.read_text()
        assert key_file.stat().st_mode & 0o777 == 0o600
        assert (tmp_path / "chatenv").stat().st_mode & 0o777 == 0o700
        assert httpx.get(f"http://127.0.0.1:{port}/state").status_code == 401
        with pytest.raises(APIError, match="API key"):
            EnvClient(f"http://127.0.0.1:{port}", "chatenv/Arithmetic-v0")
        client = EnvClient(f"http://127.0.0.1:{port}", "chatenv/Arithmetic-v0", api_key=key)
        assert client.info["env_kwargs"] == {"input_mode": "tokens", "max_turns": 2}
        assert client.reset(seed=0)[0].dtype == np.int64
        client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_concurrent_sessions_each_get_their_own_episode(servers):
    from concurrent.futures import ThreadPoolExecutor

    url = servers("chatenv/Arithmetic-v0", input_mode="history").url

    def play(seed, transport):
        client = EnvClient(url, transport=transport)
        try:
            trace = [client.reset(seed=seed)[0]]
            for text in REPLIES:
                obs, reward, terminated, truncated, _ = client.step(text)
                trace.append((obs, reward))
                if terminated or truncated:
                    break
            return trace
        finally:
            client.close()

    jobs = [(seed, "ws" if seed % 2 else "http") for seed in range(6)]
    with ThreadPoolExecutor(6) as pool:
        traces = list(pool.map(lambda job: play(*job), jobs))
    assert traces == [play(seed, "http") for seed, _ in jobs]
    assert len({str(t[0]) for t in traces}) > 1


KEY2 = "other-key-456"


class _Quirky(gym.Wrapper):
    """An env whose reset can be slow, whose step can fail or give a chosen reward (``knobs``)."""

    def __init__(self, env, knobs):
        super().__init__(env)
        self.knobs = knobs

    def reset(self, **kwargs):
        time.sleep(self.knobs.get("delay", 0.0))
        return self.env.reset(**kwargs)

    def step(self, action):
        if self.knobs.get("fail"):
            raise OSError("the disk is on fire")
        obs, reward, terminated, truncated, info = self.env.step(action)
        return obs, self.knobs.get("reward", reward), terminated, truncated, info


def _quirky_service(knobs, max_sessions=4):
    def make():
        return _Quirky(gym.make("chatenv/Arithmetic-v0"), knobs)

    probe = make()
    info = env_info(probe, "chatenv/Arithmetic-v0", {})
    probe.close()
    return EnvService(make, info, max_sessions=max_sessions)


def test_sessions_are_scoped_per_api_key():
    with EnvServer("chatenv/Arithmetic-v0", api_key=[KEY, KEY2]) as server:
        mine = EnvClient(server.url, api_key=KEY)
        mine.reset(seed=0)
        other = {"Authorization": f"Bearer {KEY2}", "X-Session-Id": mine.session_id}
        assert httpx.get(f"{server.url}/sessions", headers=other).json()["sessions"] == []
        assert mine.session_id in httpx.get(f"{server.url}/sessions", headers=mine._headers).json()["sessions"]
        # the one session-scope rule: unknown to reads (404), refused to what would create or change it (403)
        for method, path, body, status in [("GET", "/state", None, 404), ("POST", "/fork", {"session_id": "t"}, 404),
                                           ("DELETE", "/session", None, 404),
                                           ("DELETE", f"/sessions/{mine.session_id}", None, 404),
                                           ("POST", "/step", {"action": {"message": "1"}}, 403),
                                           ("POST", "/reset", {}, 403)]:  # fmt: skip
            r = httpx.request(method, f"{server.url}{path}", json=body, headers=other)
            code = "session_not_found" if status == 404 else "session_forbidden"
            assert r.status_code == status and r.json()["error"]["code"] == code, path
        theirs = EnvClient(server.url, transport="ws", api_key=KEY2, session_id=mine.session_id)
        with pytest.raises(APIError) as unknown:
            theirs.state()
        assert unknown.value.status == 404
        with pytest.raises(APIError) as forbidden:
            theirs.reset(seed=1)
        assert (forbidden.value.status, forbidden.value.code) == (403, "session_forbidden")
        key2 = {"Authorization": f"Bearer {KEY2}", "X-Session-Id": "k2"}
        assert httpx.post(f"{server.url}/reset", json={}, headers=key2).status_code == 200
        r = httpx.post(f"{server.url}/fork", json={"session_id": mine.session_id}, headers=key2)
        assert r.status_code == 403  # nor can a fork take its id
        assert mine.state()["step_count"] == 0 and mine.state()["episode_id"] is not None
        theirs.close()
        # without a session header each key has its own default session
        for key, seed in ((KEY, 0), (KEY2, 1)):
            r = httpx.post(f"{server.url}/reset", json={"seed": seed}, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200
        states = [
            httpx.get(f"{server.url}/state", headers={"Authorization": f"Bearer {k}"}).json() for k in (KEY, KEY2)
        ]
        assert [s["session_id"] for s in states] == ["default@0", "default@1"]
        assert mine.state()["session_id"] == mine.session_id
        mine.close()


def test_websocket_env_work_runs_off_the_event_loop_and_a_busy_session_answers_409():
    knobs = {"delay": 2.0}
    with EnvServer(_quirky_service(knobs)) as server:
        slow = EnvClient(server.url, transport="ws")
        worker = threading.Thread(target=slow.reset)
        worker.start()
        time.sleep(0.2)
        started = time.monotonic()
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert time.monotonic() - started < 1.0  # the slow reset does not hold the event loop
        r = httpx.get(f"{server.url}/state", headers={"X-Session-Id": slow.session_id})
        assert r.status_code == 409 and r.json()["error"]["code"] == "session_busy"
        worker.join()
        knobs["delay"] = 0.0
        assert slow.state()["episode_id"] is not None
        slow.close()
    with pytest.raises(TypeError, match="max_sessions"):
        EnvServer(_quirky_service({}), max_sessions=3)
    with pytest.raises(TypeError, match="input_mode"):
        EnvServer(_quirky_service({}), input_mode="tokens")


def test_bodies_are_streamed_with_a_limit_and_bad_json_is_400(servers):
    server = servers("chatenv/Arithmetic-v0")

    def chunks():
        for _ in range(MAX_BODY_BYTES // 65536 + 2):
            yield b" " * 65536

    r = httpx.post(f"{server.url}/reset", content=chunks(), headers={"X-Session-Id": "big"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    for raw in ["1" * 5000, "[" * 100000 + "]" * 100000, "{not json"]:
        r = httpx.post(f"{server.url}/reset", content=raw, headers={"X-Session-Id": "bad"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", raw[:10]
    with ws_connect(server.url.replace("http", "ws") + "/ws?session=wsbad") as ws:
        for raw in ['{"type": "reset", "data": {"seed": ' + "1" * 5000 + "}}", "[" * 100000, b"\x00\x01"]:
            ws.send(raw)
            reply = json.loads(ws.recv(timeout=10))
            assert reply["type"] == "error" and reply["data"]["status"] == 400
            assert reply["data"]["code"] == "INVALID_JSON" and reply["data"]["message"]
        ws.send(json.dumps({"type": "hello"}))
        assert json.loads(ws.recv(timeout=10))["data"]["code"] == "UNKNOWN_TYPE"
        ws.send(json.dumps({"type": "reset", "data": {"seed": 0}}))
        assert json.loads(ws.recv(timeout=10))["type"] == "observation"  # the connection is kept


def test_failures_nan_rewards_and_non_json_errors():
    knobs = {"reward": float("nan")}
    with EnvServer(_quirky_service(knobs)) as server:
        for transport in ("http", "ws"):
            client = EnvClient(server.url, transport=transport)
            client.reset(seed=0)
            assert math.isnan(client.step("1")[1])
            client.close()
        knobs["fail"] = True
        client = EnvClient(server.url, transport="http")
        client.reset(seed=0)
        with pytest.raises(APIError) as failed:  # uvicorn's plain "Internal Server Error"
            client.step("1")
        assert failed.value.status == 500
        client.close()
        client = EnvClient(server.url, transport="ws")
        client.reset(seed=0)
        with pytest.raises(APIError, match="disk is on fire") as failed:
            client.step("1")
        assert failed.value.status == 500
        assert client.state()["step_count"] == 0  # the socket stays open
        client.close()


def test_a_websocket_timeout_breaks_the_client_and_a_failed_connect_closes_http(monkeypatch):
    knobs = {"delay": 1.0}
    with EnvServer(_quirky_service(knobs)) as server:
        client = EnvClient(server.url, transport="ws", timeout=0.3)
        with pytest.raises(APIError, match="make a new EnvClient"):
            client.reset(seed=0)
        time.sleep(1.0)
        with pytest.raises(APIError, match="closed"):
            client.state()  # not the late reply of the reset
        client.close()
        closed = []
        real_close = httpx.Client.close
        monkeypatch.setattr(httpx.Client, "close", lambda self: closed.append(self) or real_close(self))

        def refuse(*args, **kwargs):
            raise OSError("refused")

        monkeypatch.setattr(websockets.sync.client, "connect", refuse)
        with pytest.raises(APIError, match="no WebSocket"):
            EnvClient(server.url, transport="ws")
        assert len(closed) == 1


def test_fork_closes_an_unadmitted_copy_and_a_fresh_fork_has_no_episode(servers, monkeypatch):
    server = servers("chatenv/Arithmetic-v0")
    client = EnvClient(server.url)
    client.reset(seed=0)
    client.step("1")
    fresh, twin = client.fork(episode=False), client.fork()
    state = fresh.state()
    assert (state["episode_id"], state["step_count"]) == (None, 0)
    assert twin.state()["step_count"] == 1
    for each in (client, fresh, twin):
        each.close()
    service = _quirky_service({})
    service.reset("a", {})
    closed = []

    def twin_of(env, episode):
        twin = gym.make("chatenv/Arithmetic-v0")
        monkeypatch.setattr(twin, "close", lambda: closed.append(twin))
        return twin

    def full(sid, scope, env):
        raise APIError("full", status=503, code="too_many_sessions")

    monkeypatch.setattr(chatenv.envserver.sessions, "fork", twin_of)
    monkeypatch.setattr(service, "_admit", full)
    with pytest.raises(APIError, match="full"):
        service.fork("a", {"session_id": "b"})
    assert len(closed) == 1
    service.close()


def test_a_websocket_without_a_session_has_its_own_env_closed_when_it_ends(servers):
    url = servers("chatenv/Arithmetic-v0", input_mode="history").url
    before = set(httpx.get(f"{url}/sessions").json()["sessions"])
    with ws_connect(url.replace("http", "ws") + "/ws") as a, ws_connect(url.replace("http", "ws") + "/ws") as b:
        for ws, seed in ((a, 0), (b, 1)):
            ws.send(json.dumps({"type": "reset", "data": {"seed": seed}}))
            assert json.loads(ws.recv(timeout=10))["type"] == "observation"
        a.send(json.dumps({"type": "step", "data": {"message": "1"}}))
        assert json.loads(a.recv(timeout=10))["data"]["observation"]["messages"][-2]["content"] == "1"
        b.send(json.dumps({"type": "state"}))
        state = json.loads(b.recv(timeout=10))
        assert state["type"] == "state" and state["data"]["step_count"] == 0
        opened = set(httpx.get(f"{url}/sessions").json()["sessions"]) - before
        assert len(opened) == 2 and all(sid.startswith("ws-") for sid in opened)
        b.send(json.dumps({"type": "close"}))
        assert json.loads(b.recv(timeout=10))["type"] == "result"
    deadline = time.monotonic() + 10
    while set(httpx.get(f"{url}/sessions").json()["sessions"]) != before:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with (
        EnvServer("chatenv/Arithmetic-v0", max_sessions=1) as server,
        ws_connect(server.url.replace("http", "ws") + "/ws") as first,
    ):
        first.send(json.dumps({"type": "state"}))
        assert json.loads(first.recv(timeout=10))["type"] == "state"  # its session is open
        with ws_connect(server.url.replace("http", "ws") + "/ws") as full:  # a connection's env is never evicted
            refused = json.loads(full.recv(timeout=10))
            assert refused["type"] == "error" and refused["data"]["code"] == "CAPACITY_REACHED"
