"""MCPServer against a real MCP server subprocess (tests/mcp_server.py)."""

import asyncio
import gc
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from chatenv import ChatEnv
from chatenv.errors import ChatEnvError, MissingDependencyError
from chatenv.tools import Toolbox
from chatenv.tools.base import Tool
from chatenv.tools.loop import run_coroutine
from chatenv.tools.mcp import MCPServer, MCPServerError, MCPToolError, result_text

pytestmark = pytest.mark.slow  # each test starts real MCP server subprocesses (about a second each)

SERVER = str(Path(__file__).parent.parent / "mcp_server.py")


def start(**kwargs) -> MCPServer:
    return MCPServer(sys.executable, [SERVER], **kwargs)


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (not gone, not a zombie)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def wait_gone(pid: int, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture(scope="module")
def server():
    with start(call_timeout=20.0) as srv:
        yield srv


def by_name(tools: list[Tool]) -> dict[str, Tool]:
    return {t.name: t for t in tools}


def test_tools_have_the_servers_schemas(server):
    tools = by_name(server.tools())
    assert {"add", "echo", "fail", "slow", "counter", "pid"} <= set(tools)
    add = tools["add"]
    assert add.is_async and add.timeout == 20.0 and not add.concurrent
    assert add.schema["type"] == "function"
    fn = add.schema["function"]
    assert fn["name"] == "add" and fn["description"] == "Add two integers."
    assert fn["parameters"]["type"] == "object"
    assert sorted(fn["parameters"]["required"]) == ["a", "b"]
    assert fn["parameters"]["properties"]["a"]["type"] == "integer"
    assert tools["echo"].parameters["required"] == ["text"]
    assert not tools["counter"].parameters.get("required")
    assert add.check_arguments({"a": 1}) == "missing required argument 'b'"
    assert server.tools() == list(tools.values())  # listed once, then cached


def test_calls_through_the_tool_fn_and_call(server):
    tools = by_name(server.tools())
    assert run_coroutine(tools["add"].fn(a=2, b=3), 20) == "5"
    assert run_coroutine(tools["echo"].fn(text="héllo\nworld"), 20) == "héllo\nworld"
    assert server.call("add", {"a": -1, "b": 1}) == "0"
    assert server.call("echo", {"text": "hi"}, timeout=20) == "hi"
    assert server.call("pid") == str(server.pid)


def test_the_tool_fn_can_be_awaited_from_another_event_loop(server):
    tools = by_name(server.tools())

    async def both():
        return await asyncio.gather(tools["add"].fn(a=1, b=1), tools["echo"].fn(text="x"))

    assert asyncio.run(both()) == ["2", "x"]


def test_a_tool_error_raises_with_the_servers_message(server):
    with pytest.raises(MCPToolError, match="boom: the disk is full") as info:
        server.call("fail", {"message": "boom: the disk is full"})
    assert isinstance(info.value, RuntimeError)
    with pytest.raises(MCPToolError, match="boom"):
        run_coroutine(by_name(server.tools())["fail"].fn(message="boom"), 20)
    with pytest.raises(MCPToolError, match="nope"):
        server.call("nope", {})
    assert server.call("add", {"a": 1, "b": 1}) == "2"


def test_results_as_text(server):
    assert server.call("mixed") == "a picture:\n[image: image/png]"
    assert server.call("structured") == '{"ok": true, "items": [1, 2]}'


def test_result_text_keeps_every_kind_of_block():
    from mcp.types import CallToolResult, EmbeddedResource, ResourceLink, TextResourceContents

    link = ResourceLink(name="log", uri="file:///tmp/log.txt")
    embedded = EmbeddedResource(type="resource", resource=TextResourceContents(uri="file:///a.txt", text="inside"))
    result = CallToolResult(content=[link, embedded])
    assert result_text(result) == "[resource link: file:///tmp/log.txt]\ninside"
    assert result_text(CallToolResult(content=[])) == ""


def test_a_slow_call_times_out_and_the_session_still_works(server):
    before = int(server.call("counter"))
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="'slow'.*0.3 s"):
        server.call("slow", {"seconds": 10}, timeout=0.3)
    # The server answers after 10 s: raising within 8 s shows the 0.3 s timeout ended the wait, not the reply.
    assert time.monotonic() - t0 < 8
    with pytest.raises(TimeoutError):
        run_coroutine(by_name(server.tools())["slow"].fn(seconds=10), 0.3)
    assert server.call("slow", {"seconds": 0.01}) == "slept 0.01"
    assert int(server.call("counter")) == before + 1


def test_close_stops_the_server_process():
    with start() as srv:
        pid = srv.pid
        assert pid is not None and running(pid)
        assert srv.call("pid") == str(pid)
        tools = srv.tools()
    assert not running(pid)
    srv.close()  # again: fine
    srv.close()
    assert srv.closed and "closed" in repr(srv)
    with pytest.raises(MCPServerError, match="closed"):
        srv.tools()
    with pytest.raises(MCPServerError, match="closed"):
        srv.call("add", {"a": 1, "b": 2})
    with pytest.raises(MCPServerError, match="closed"):
        run_coroutine(tools[0].fn(a=1, b=2), 5)


def test_garbage_collection_stops_the_server():
    srv = start()
    pid = srv.pid
    del srv
    gc.collect()
    assert wait_gone(pid)


def test_a_killed_server_fails_calls_clearly():
    srv = start()
    try:
        tools = by_name(srv.tools())
        killer = threading.Timer(0.5, os.kill, (srv.pid, signal.SIGKILL))
        killer.start()
        t0 = time.monotonic()
        with pytest.raises(MCPServerError, match="mcp_server.py.*not running") as info:
            srv.call("slow", {"seconds": 30}, timeout=20)  # in flight when the server dies
        # The call's own timeout is 20 s: failing within 15 s shows the death was noticed, not waited out.
        assert time.monotonic() - t0 < 15
        killer.join()
        assert isinstance(info.value, ChatEnvError)
        assert wait_gone(srv.pid)
        with pytest.raises(MCPServerError, match="not running"):
            srv.call("add", {"a": 1, "b": 2}, timeout=10)
        with pytest.raises(MCPServerError, match="not running"):
            run_coroutine(tools["echo"].fn(text="x"), 10)
    finally:
        srv.close()
    with pytest.raises(MCPServerError, match="closed"):
        srv.call("add", {"a": 1, "b": 2})


def test_a_server_left_open_is_stopped_at_interpreter_exit(tmp_path):
    script = (
        "import sys\n"
        "from chatenv.tools.mcp import MCPServer\n"
        f"server = MCPServer(sys.executable, [{SERVER!r}])\n"
        "print(server.pid, flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert wait_gone(int(done.stdout.split()[-1]))


def test_two_servers_are_independent(server):
    with start() as other:
        assert other.pid != server.pid
        base = int(server.call("counter"))
        assert [other.call("counter") for _ in range(3)] == ["1", "2", "3"]
        assert server.call("counter") == str(base + 1)
        assert other.call("echo", {"text": "b"}) == "b"
    assert not running(other.pid)
    assert server.call("add", {"a": 2, "b": 2}) == "4"


def test_a_server_that_exits_at_startup_is_reported_with_its_stderr():
    code = "import sys; print('no config file found', file=sys.stderr); sys.exit(3)"
    with pytest.raises(MCPServerError, match=r"failed to start(.|\n)*no config file found"):
        MCPServer(sys.executable, ["-c", code])
    with pytest.raises(MCPServerError, match="failed to start"):
        MCPServer(str(Path(SERVER).with_name("no-such-server")))


def test_a_server_that_does_not_answer_times_out_at_startup():
    t0 = time.monotonic()
    with pytest.raises(MCPServerError, match="did not start within 0.5 s"):
        MCPServer(sys.executable, ["-c", "import sys; sys.stdin.read()"], startup_timeout=0.5)
    # The default startup timeout is 30 s: failing within 20 s shows the 0.5 s one was used.
    assert time.monotonic() - t0 < 20


def test_args_must_be_a_sequence():
    with pytest.raises(TypeError, match="sequence"):
        MCPServer(sys.executable, SERVER)


def test_missing_mcp_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "mcp", None)
    with pytest.raises(MissingDependencyError, match=r'pip install "chatenv-gym\[mcp\]"'):
        MCPServer(sys.executable, [SERVER])


def test_an_env_calls_the_servers_tools(server, tokenizer):
    env = ChatEnv("arithmetic", tokenizer=tokenizer, tools=Toolbox(server.tools(), timeout=20.0), max_turns=4)
    env.reset(seed=0)
    prompt = env.chat_tokenizer.decode(env.token_ids.tolist())
    assert '"name": "add"' in prompt and '"name": "fail"' in prompt  # the server's schemas are in the prompt
    calls = [
        {"name": "add", "arguments": {"a": 20, "b": 22}},
        {"name": "fail", "arguments": {"message": "disk full"}},
        {"name": "add", "arguments": {"a": "x"}},
    ]
    _, reward, terminated, _, info = env.step({"role": "assistant", "content": "", "tool_calls": calls})
    results = [m["content"] for m in env.messages[-3:]]
    assert results[0] == "42"
    assert results[1].startswith("Error: 'fail' raised") and "disk full" in results[1]
    assert results[2].startswith("Error: bad arguments for 'add'")
    assert info["tool_turn"]["error_kinds"] == {"raised": 1, "arguments": 1} and not terminated
