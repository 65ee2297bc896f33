"""One server process over streamable HTTP for the transport and load tests (starting one costs seconds)."""

from __future__ import annotations

import logging

import pytest
from _rel_common import serve_http, stop, wait_http


@pytest.fixture(autouse=True)
def _quiet_sdk():
    # The SDK logs every failed tool call; hostile inputs make thousands of them.
    logging.getLogger("mcp").setLevel(logging.CRITICAL)


@pytest.fixture(scope="session")
def http_server(tmp_path_factory):
    """`mcore-advisor serve --http` as shipped: loopback, no token, the default body limit. Yields (url, pid)."""
    proc, url = serve_http(tmp_path_factory.mktemp("http-state"))
    wait_http(url, proc)
    yield url, proc.pid
    stop(proc)
