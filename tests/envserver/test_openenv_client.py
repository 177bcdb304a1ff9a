"""OpenEnv's own released client (openenv-core 0.3.0, its venv) and ``openenv validate`` against our env server.

Every registered env is served (turn-level ones in each input mode, the token-level one); one run of
openenv-core's ``GenericEnvClient`` (WebSocket; 0.3.0 has no HTTP client, so the HTTP routes are driven with its
own request models) resets, steps and reads the state of each with OpenEnv-shaped actions, and the observations
equal the same env's in this process.
"""

import json
import os
import subprocess

import gymnasium as gym
import pytest

import chatenv  # noqa: F401  (registers the envs)
from chatenv.envserver import EnvServer
from chatenv.envserver.protocol import observation_dict
from chatenv.envserver.wire import to_json
from tests.helpers import client_python, run_client

MODES = ("history", "text", "tokens")
REPLY = "<answer>4</answer>"

_CLIENT = r"""
import json, sys
import requests
from openenv.core.generic_client import GenericEnvClient
from openenv.core.env_server.types import ResetRequest, ResetResponse, StepRequest, StepResponse, State

def error_of(fn):
    try:
        fn()
    except RuntimeError as e:
        return str(e)
    return None

out = []
for job in json.loads(sys.argv[1]):
    url, action = job["url"], job["action"]
    with GenericEnvClient(base_url=url).sync() as a, GenericEnvClient(base_url=url).sync() as b:
        first = a.reset(seed=3)
        other = b.reset(seed=4)
        step = a.step(action)
        state_a, state_b = a.state(), b.state()
        bad = error_of(lambda: a.step({"bogus": 1}))
    with GenericEnvClient(base_url=url).sync() as c:
        early = error_of(lambda: c.step(action))
    # the HTTP routes, with OpenEnv's own request models (and its response models on their fields)
    session = {"X-Session-Id": "http-" + str(len(out))}
    r = requests.post(url + "/reset", json=ResetRequest(seed=3).model_dump(exclude_none=True), headers=session)
    http_reset = ResetResponse.model_validate({k: r.json()[k] for k in ResetResponse.model_fields})
    body = StepRequest(action=action).model_dump(exclude_none=True)
    r = requests.post(url + "/step", json=body, headers=session)
    http_step = StepResponse.model_validate({k: r.json()[k] for k in StepResponse.model_fields})
    http_state = State.model_validate(requests.get(url + "/state", headers=session).json())
    r = requests.post(url + "/step", json=StepRequest(action={"bogus": 1}).model_dump(), headers=session)
    out.append({
        "reset": [first.observation, first.reward, first.done],
        "other": other.observation,
        "step": [step.observation, step.reward, step.done],
        "state_a": [state_a["episode_id"], state_a["step_count"]],
        "state_b": [state_b["episode_id"], state_b["step_count"]],
        "bad": bad, "early": early,
        "http": [http_reset.observation, http_step.observation, http_step.reward, http_step.done,
                 http_state.step_count, r.status_code, r.json()["detail"]],
    })
print(json.dumps(out))
"""


def _configs():
    ids = [k for k in gym.registry if k.startswith("chatenv/")]
    assert len(ids) >= 7
    token_level = [k for k in ids if "Token" in k]
    return [(k, {}) for k in token_level] + [(k, {"input_mode": m}) for k in ids if k not in token_level for m in MODES]


def _action(env, kwargs):
    """The OpenEnv action of the reply REPLY after ``env``'s reset, and the step(s) that reply is locally."""
    base = env.unwrapped
    ids = base.chat_tokenizer.reply(base.messages, {"role": "assistant", "content": REPLY}).ids.tolist()
    if isinstance(env.action_space, gym.spaces.Discrete):
        return {"token": ids[0]}, ids[0]
    if kwargs.get("input_mode") == "tokens":
        return {"tokens": ids}, ids
    return {"message": REPLY, "metadata": {}}, REPLY


@pytest.mark.slow
def test_openenv_generic_client_drives_every_registered_env():
    configs = _configs()
    servers = [EnvServer(env_id, **kwargs).start() for env_id, kwargs in configs]
    try:
        jobs, expected = [], []
        for (env_id, kwargs), server in zip(configs, servers):
            local = gym.make(env_id, **kwargs)
            info = server.service.info
            obs, _ = local.reset(seed=3)
            action, local_action = _action(local, kwargs)
            after = local.step(local_action)
            other = gym.make(env_id, **kwargs).reset(seed=4)[0]
            done = bool(after[2] or after[3])
            expected.append((observation_dict(to_json(obs), info), observation_dict(to_json(after[0]), info),
                             float(after[1]), done, observation_dict(to_json(other), info)))  # fmt: skip
            jobs.append({"url": server.url, "action": action})
            local.close()
        results = json.loads(run_client("openenv", _CLIENT, json.dumps(jobs)).stdout)
    finally:
        for server in servers:
            server.stop()
    assert len(results) == len(configs)
    for (env_id, kwargs), got, (obs, after, reward, done, other) in zip(configs, results, expected):
        where = (env_id, kwargs)
        assert got["reset"] == [obs, None, False], where
        assert got["step"] == [after, reward, done], where
        assert got["other"] == other, where  # its own env, reset with seed 4
        # two connections, two envs: each has its own episode and step count
        assert got["state_a"][1] == 1 and got["state_b"][1] == 0 and got["state_a"][0] != got["state_b"][0], where
        # errors reach OpenEnv's client with their message and OpenEnv's code
        assert "unknown action field(s) ['bogus']" in got["bad"] and "(code: VALIDATION_ERROR)" in got["bad"], where
        assert "reset" in got["early"] and "(code: EXECUTION_ERROR)" in got["early"], where
        http_reset, http_after, http_reward, http_done, http_steps, status, detail = got["http"]
        assert [http_reset, http_after, http_reward, http_done, http_steps] == [obs, after, reward, done, 1], where
        assert status == 422 and detail[0]["loc"] == ["body", "action", "bogus"], where


@pytest.mark.slow
def test_openenv_validate_passes():
    with EnvServer("chatenv/Arithmetic-v0", input_mode="tokens") as server:
        cli = os.path.join(os.path.dirname(client_python("openenv")), "openenv")
        done = subprocess.run([cli, "validate", "--url", server.url], capture_output=True, text=True, timeout=120)
    report = json.loads(done.stdout)
    assert done.returncode == 0 and report["passed"], done.stdout + done.stderr
    assert {c["id"] for c in report["criteria"]} >= {"health_endpoint", "metadata_endpoint", "schema_endpoint",
                                                     "mcp_endpoint", "mode_endpoint_consistency"}  # fmt: skip
    assert report["mode"] == "simulation" and report["standard_profile"] == "openenv-http/1.x"


def test_the_server_publishes_openenv_schemas_and_metadata():
    import httpx
    import jsonschema

    with EnvServer("chatenv/CalculatorArithmetic-v0", input_mode="history") as server:
        url = server.url
        schema = httpx.get(f"{url}/schema").json()
        for valid in ({"message": "hi"}, {"message": {"role": "assistant", "content": "hi"}}, {"tokens": [1, 2]}):
            jsonschema.validate(valid, schema["action"])
        for invalid in ({"message": "hi", "tokens": [1]}, {"text": "hi"}, {"tokens": [1.5]}, {}):
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(invalid, schema["action"])
        reset = httpx.post(f"{url}/reset", json={"seed": 0, "episode_id": "ep-7"}).json()
        jsonschema.validate(reset["observation"], schema["observation"])
        state = httpx.get(f"{url}/state").json()
        jsonschema.validate(state, schema["state"])
        assert state["episode_id"] == "ep-7"
        assert httpx.get(f"{url}/metadata").json()["name"] == "chatenv/CalculatorArithmetic-v0"
        tools = httpx.post(f"{url}/mcp", json={"jsonrpc": "2.0", "method": "tools/list", "id": 1}).json()
        assert tools["id"] == 1 and [t["name"] for t in tools["result"]["tools"]] == ["calculator"]
        called = httpx.post(f"{url}/mcp", json={"jsonrpc": "2.0", "method": "tools/call", "id": 2}).json()
        assert called["error"]["code"] == -32601
        assert httpx.post(f"{url}/mcp", content="{nope").json()["error"]["code"] == -32700
