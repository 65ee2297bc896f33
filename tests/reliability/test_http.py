"""The streamable-HTTP transport of `mcore-advisor serve --http`: bind policy, bearer token, Host/Origin, body limit."""

from __future__ import annotations

import socket

import httpx
import pytest
from _rel_common import free_port, serve_http, stop, wait_http

from mcore_advisor.server import app, transport

INIT = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}}
HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


@pytest.fixture
def open_server(http_server):
    return http_server[0]


@pytest.fixture(scope="module")
def token_server(tmp_path_factory):
    """127.0.0.2: loopback to the kernel but not a loopback name to us, so it needs a token."""
    port = free_port()
    proc, _ = serve_http(tmp_path_factory.mktemp("state"), "--host", "127.0.0.2", port=port,
                         env={"MCORE_ADVISOR_TOKEN": "t0ken-of-32-characters-abcdefgh"})
    url = f"http://127.0.0.2:{port}/mcp"
    wait_http(url, proc)
    yield url
    stop(proc)


def _post(url: str, headers: dict[str, str] | None = None, body: bytes | None = None) -> httpx.Response:
    import json

    return httpx.post(url, headers={**HEADERS, **(headers or {})}, content=body or json.dumps(INIT).encode(), timeout=30)


def test_a_plain_loopback_request_is_served(open_server):
    r = _post(open_server)
    assert r.status_code == 200, r.text
    assert "mcore-advisor" in r.text  # the initialize answer names the server


def test_a_foreign_host_header_is_refused_421_against_dns_rebinding(open_server):
    r = _post(open_server, {"Host": "attacker.example:80"})
    assert r.status_code == 421


def test_a_foreign_origin_is_refused_403(open_server):
    assert _post(open_server, {"Origin": "http://attacker.example"}).status_code == 403
    assert _post(open_server, {"Origin": "http://localhost:1234"}).status_code == 200


def test_a_body_over_the_limit_is_refused_413_before_it_is_parsed(open_server):
    over = int(transport.MAX_BODY_MB * 2**20) + 1
    big = b'{"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"x": "' + b"a" * over + b'"}}'
    assert _post(open_server, body=big).status_code == 413


def test_without_the_token_401_with_a_wrong_one_401_with_the_right_one_200(token_server):
    assert _post(token_server).status_code == 401
    assert _post(token_server, {"Authorization": "Bearer wrong"}).status_code == 401
    assert _post(token_server, {"Authorization": "Bearer t0ken-of-32-characters-abcdefgX"}).status_code == 401
    assert _post(token_server, {"Authorization": "Bearer t0ken-of-32-characters-abcdefgh"}).status_code == 200


def test_a_non_loopback_bind_checks_the_host_header_too(token_server):
    auth = {"Authorization": "Bearer t0ken-of-32-characters-abcdefgh"}
    assert _post(token_server, {**auth, "Host": "attacker.example"}).status_code == 421
    assert _post(token_server, {**auth, "Host": f"{socket.gethostname()}:8000"}).status_code == 200


def test_a_non_loopback_bind_without_a_token_is_refused_at_start(tmp_path, monkeypatch, capsys):
    from mcore_advisor import cli

    monkeypatch.setenv("MCORE_ADVISOR_STATE_DIR", str(tmp_path))
    monkeypatch.delenv("MCORE_ADVISOR_TOKEN", raising=False)
    assert cli.main(["serve", "--http", "--host", "0.0.0.0", "--port", str(free_port())]) == 2
    assert "--host 0.0.0.0 is not loopback: set a bearer token in $MCORE_ADVISOR_TOKEN" in capsys.readouterr().err


def test_the_token_is_compared_in_constant_time(monkeypatch):
    import anyio

    calls = []
    real = app.secrets.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(app.secrets, "compare_digest", spy)
    verifier = app.StaticTokenVerifier("s3cret-token-value")
    assert anyio.run(verifier.verify_token, "s3cret-token-value") is not None
    assert anyio.run(verifier.verify_token, "s3cret-token-valuE") is None
    assert anyio.run(verifier.verify_token, "") is None
    assert calls == [(b"s3cret-token-value", b"s3cret-token-value"), (b"s3cret-token-valuE", b"s3cret-token-value"),
                     (b"", b"s3cret-token-value")]


def test_allow_lists_name_the_bind_address_this_host_and_extra_names():
    sec = transport.security("0.0.0.0", ["alias.example"])
    assert "alias.example:*" in sec.allowed_hosts and f"{socket.gethostname()}:*" in sec.allowed_hosts
    assert "0.0.0.0:*" not in sec.allowed_hosts  # a wildcard is no name a client uses
    assert "http://alias.example:*" in sec.allowed_origins and "https://alias.example:*" in sec.allowed_origins
    assert "[::1]:*" in transport.security("::1").allowed_hosts
    with pytest.raises(ValueError, match="set a bearer token"):
        transport.check_bind("10.0.0.5", None, "MCORE_ADVISOR_TOKEN")
    transport.check_bind("127.0.0.1", None, "MCORE_ADVISOR_TOKEN")
