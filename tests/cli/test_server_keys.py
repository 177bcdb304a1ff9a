"""Servers started from the command line make an API key when none is given: another user cannot use them."""

import argparse
import os
import socket
import stat

import pytest

from chatenv.cli.serve import listening_problem, server_keys
from chatenv.web import make_local_key


def test_a_made_key_is_random_and_readable_only_by_its_owner(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    folder = tmp_path / "chatenv"
    folder.mkdir(mode=0o755)  # a folder others can list is made private before a key goes in
    key, path = make_local_key("serve", "127.0.0.1", 8000)
    again, same_path = make_local_key("serve", "127.0.0.1", 8000)
    assert path == same_path == str(folder / "serve-127.0.0.1-8000.key") and key != again and len(key) >= 32
    with open(path) as f:
        assert f.read() == again + "\n"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and stat.S_IMODE(folder.stat().st_mode) == 0o700
    ipv6, _ = make_local_key("serve", "[::1]", 8001)
    assert (folder / "serve-__1-8001.key").read_text().strip() == ipv6


def test_a_link_in_place_of_the_key_file_is_never_followed(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    (tmp_path / "chatenv").mkdir(mode=0o700)
    target = tmp_path / "elsewhere.txt"
    target.write_text("kept")
    os.symlink(target, tmp_path / "chatenv" / "serve-127.0.0.1-9.key")
    with pytest.raises(OSError):
        make_local_key("serve", "127.0.0.1", 9)
    assert target.read_text() == "kept"


def _args(**given):
    base = {"host": "127.0.0.1", "port": 8000, "api_key": None, "no_api_key": False}
    return argparse.Namespace(**{**base, **given})


def test_keys_given_none_asked_for_or_made(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("CHATENV_API_KEY", raising=False)
    assert server_keys(_args(api_key=["secret-key-1"]), "serve") == ["secret-key-1"]
    assert server_keys(_args(no_api_key=True), "serve") is None
    made = server_keys(_args(port=0), "serve")
    out, path = capsys.readouterr().out, tmp_path / "chatenv" / "serve-127.0.0.1-0.key"
    assert made is not None and made[0] not in out and str(path) in out  # the path is printed, never the key
    assert path.read_text().strip() == made[0]
    with socket.socket() as taken:  # a port in use: the running server's key file is left alone
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        (tmp_path / "chatenv" / f"serve-127.0.0.1-{port}.key").write_text("theirs\n")
        with pytest.raises(OSError):
            server_keys(_args(port=port), "serve")
        assert (tmp_path / "chatenv" / f"serve-127.0.0.1-{port}.key").read_text() == "theirs\n"
    assert "contradict" in listening_problem(_args(no_api_key=True, api_key=["secret-key-1"]))
    assert "API key" in listening_problem(_args(host="0.0.0.0"))  # beyond loopback: a key the user gives
    assert listening_problem(_args(host="0.0.0.0", api_key=["secret-key-1"])) is None
