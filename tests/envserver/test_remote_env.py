"""RemoteEnv: an env on a real openenv-core server (its own example env, made by ``openenv init``) as a gym.Env."""

import os
import socket
import subprocess
import time
import warnings

import gymnasium as gym
import httpx
import numpy as np
import pytest

import chatenv
from chatenv.envserver import EnvServer
from chatenv.envserver.remote import JSONValue, RemoteEnv, space_from_schema
from chatenv.spaces import ChatText
from tests.helpers import client_python

# openenv-core's server helpers (create_app) around the echo env that `openenv init` writes from its template
_SERVER = r"""
import sys
import uvicorn
from openenv.cli.commands.init import init
init("echo_env", output_dir=sys.argv[1])
sys.path.insert(0, sys.argv[1])
from openenv.core.env_server.http_server import create_app
from echo_env.models import EchoAction, EchoObservation
from echo_env.server.echo_env_environment import EchoEnvironment
app = create_app(EchoEnvironment, EchoAction, EchoObservation, env_name="echo_env", max_concurrent_envs=4)
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
"""


@pytest.fixture(scope="module")
def echo_url(tmp_path_factory):
    folder = tmp_path_factory.mktemp("openenv")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(folder / "server.log", "w")  # noqa: SIM115 - closed below
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy") and k != "PYTHONPATH"}
    proc = subprocess.Popen([client_python("openenv"), "-c", _SERVER, str(folder), str(port)], stdout=log,
                            stderr=subprocess.STDOUT, env=env)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (folder / "server.log").read_text()
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


@pytest.mark.slow
def test_an_openenv_env_steps_as_a_gym_env(echo_url):
    a, b = RemoteEnv(echo_url), RemoteEnv(echo_url)
    try:
        assert a.action_space == gym.spaces.Dict({"message": ChatText()})
        assert set(a.observation_space.spaces) == {"echoed_message", "message_length"}
        assert a.env_metadata["name"]
        obs, info = a.reset(seed=0)
        assert obs["echoed_message"] == "Echo Env environment ready!" and obs["message_length"] == np.int64(0)
        assert a.observation_space.contains(obs) and info == {"reward": 0.0}
        obs, reward, terminated, truncated, info = a.step({"message": "héllo 🙂"})
        assert obs["echoed_message"] == "héllo 🙂" and int(obs["message_length"]) == 7
        assert reward == pytest.approx(0.7) and (terminated, truncated) == (False, False)
        b.reset()
        a.step({"message": "again"})
        assert a.state()["step_count"] == 2 and b.state()["step_count"] == 0  # one env per connection
        assert a.state()["episode_id"] != b.state()["episode_id"]
        with pytest.raises(ValueError, match=r"code: VALIDATION_ERROR"):
            a.step({"nope": 1})
        with pytest.raises(TypeError, match="mapping"):
            a.step("hello")
        assert a.state()["step_count"] == 2
    finally:
        a.close()
        b.close()
    a.close()  # twice is fine


@pytest.mark.slow
def test_an_openenv_env_passes_the_checks_that_apply(echo_url):
    from gymnasium.utils.env_checker import check_env

    env = RemoteEnv(echo_url)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            check_env(env, skip_render_check=True)
        assert [str(w.message) for w in caught] == []
    finally:
        env.close()
    # chatenv.check: Gymnasium's checks apply to any env; the rest need a chat env's token view, which an echo env
    # has not
    report = chatenv.check(lambda: RemoteEnv(echo_url))
    assert report.ok and report.results[0].name == "gymnasium_check_env" and report.results[0].applies, str(report)
    assert [r.applies for r in report.results[1:]] == [False] * (len(report.results) - 1)
    assert "n/a" in str(report)


def test_remote_env_on_chatenvs_own_server():
    with EnvServer("chatenv/Arithmetic-v0", input_mode="history", max_turns=1) as server:
        env = RemoteEnv(server.url)
        try:
            assert isinstance(env.action_space, gym.spaces.Dict) and set(env.action_space.spaces) == set()
            obs, _ = env.reset(seed=1)
            local = gym.make("chatenv/Arithmetic-v0", input_mode="history", max_turns=1)
            expected, _ = local.reset(seed=1)
            assert obs == {"messages": tuple(expected)}
            with pytest.raises(TypeError, match="integers"):
                env.step({"tokens": [1.5]})
            obs, reward, terminated, truncated, info = env.step({"message": "<answer>1</answer>"})
            out = local.step("<answer>1</answer>")
            assert reward == float(out[1]) and (terminated, truncated) == out[2:4] and info["turn"] == 1
            assert truncated or terminated
        finally:
            env.close()
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
              "x": {"anyOf": [{"type": "number"}, {"type": "null"}]}, "ok": {"type": "boolean"},
              "sub": {"$ref": "#/$defs/Sub"}}, "$defs": {"Sub": {"type": "object", "properties":
              {"v": {"type": "array", "items": {"type": "string"}}}}}}  # fmt: skip
    space = space_from_schema(schema)
    assert space["n"] == gym.spaces.Box(0, 9, shape=(), dtype=np.int64) and isinstance(space["x"], JSONValue)
    assert space["ok"] == gym.spaces.Discrete(2) and space["sub"]["v"] == gym.spaces.Sequence(ChatText())
