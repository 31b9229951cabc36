"""`layerstream serve` as strangers meet it, on the shared server (its defaults): half-open sockets closed while
clients are answered, curl from loopback unchanged, a rebinding Host and a cross-site form refused; and OpenAI's
client with a key (in process)."""

from __future__ import annotations

import shutil
import socket
import subprocess

import pytest

from layerstream.server.access import AccessSettings
from layerstream.server.connections import MAX_WAITING_CONNECTIONS
from serve_harness import closed_by_server, wait_until
from test_access import KEY, LOCAL, _client

HALF_OPEN = 300  # what an attacker held open for good before the head deadline existed


def test_half_open_sockets_are_closed_and_clients_still_answered(shared_server):
    server = shared_server("tiny-flux")
    port = int(server.url.rsplit(":", 1)[1])
    sockets = []
    try:
        for i in range(HALF_OPEN):
            s = socket.create_connection(("127.0.0.1", port))
            if i % 2:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # a head that never ends
            sockets.append(s)
        # past the cap the oldest close at once, the rest by the head deadline; meanwhile clients are answered
        wait_until(lambda: all(closed_by_server(s) for s in sockets[: HALF_OPEN - MAX_WAITING_CONNECTIONS]), what="cap")
        with server.client() as client:
            assert client.get("/health").status_code == 200
        wait_until(lambda: all(closed_by_server(s) for s in sockets), timeout=120, what="every half-open socket closed")
    finally:
        for s in sockets:
            s.close()


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_curl_from_loopback_works_and_a_rebinding_host_or_cross_site_form_is_refused(shared_server):
    url = shared_server("tiny-flux").url

    def curl(*args: str) -> tuple[int, str]:
        done = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return int(done.stdout), done.stderr

    assert curl(f"{url}/health")[0] == 200 and curl(f"{url}/v1/models")[0] == 200
    assert curl("-H", "Host: attacker.example", f"{url}/health")[0] == 403
    form = ["-H", "Origin: https://attacker.example", "--data-urlencode", "prompt=x", f"{url}/v1/images/jobs"]
    assert curl(*form)[0] == 403


def test_openais_client_sends_its_key_and_lists_the_model():
    """OpenAI's client sends ``Authorization: Bearer KEY`` by itself: it works unchanged, and a wrong key is its
    AuthenticationError with the server's one line."""
    openai = pytest.importorskip("openai")  # in process, but it starts a process of its own (platform facts)
    keyed = _client(AccessSettings(api_key=KEY))
    client = openai.OpenAI(base_url=f"{LOCAL}/v1", api_key=KEY, http_client=keyed, max_retries=0)
    assert [model.id for model in client.models.list()] == ["stand-in"]
    wrong = openai.OpenAI(base_url=f"{LOCAL}/v1", api_key="sk-wrong", http_client=keyed, max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="missing or wrong API key"):
        wrong.models.list()
