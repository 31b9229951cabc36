"""Who may talk to the server (`layerstream.server.access`), on the app in process: the Host a request names (DNS
rebinding), the Origin of a state-changing request, CORS only when asked, the API key (a header, or the page's
cookie on its own reads), `GET /v1/models` and --served-model-name, and no local path in an answer. Header values
come from strangers: hypothesis writes them."""

from __future__ import annotations

import string
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from layerstream.cli.main import build_parser
from layerstream.cli.serve_access import access_settings
from layerstream.cli.common import CliError
from layerstream.config.offload_config import parse_offload_config
from layerstream.models.hub import ModelSource
from layerstream.server.access import AccessSettings, AccessSettingsError, HostRule, split_host
from layerstream.server.app import create_app
from layerstream.server.errors import client_line
from layerstream.server.service import GenerationService
from layerstream.server.settings import ServeSettings, ServeSettingsError
from test_service import StandInOmni

pytestmark = pytest.mark.fast

KEY = "sk-test-0123456789"
LOCAL = "http://127.0.0.1:8000"
HYPOTHESIS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _client(access: AccessSettings | None = None, base_url: str = LOCAL, **serve) -> TestClient:
    """An app with `access`; without, `create_app`'s default (a loopback server's checks: `loopback` tests them)."""
    service = GenerationService(StandInOmni(), ServeSettings(port=0, shutdown_timeout=0, **serve))
    return TestClient(create_app(service, access=access), base_url=base_url)


@pytest.fixture(scope="module")
def loopback():
    with _client() as client:
        yield client


@pytest.fixture(scope="module")
def keyed():
    with _client(AccessSettings(api_key=KEY)) as client:
        yield client


# --- Host ------------------------------------------------------------------------------------------------------

labels = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,10}[a-z0-9])?", fullmatch=True)
foreign_names = st.lists(labels, min_size=2, max_size=4).map(".".join).filter(
    lambda name: name.split(".")[-1] != "localhost" and not all(part.isdigit() for part in name.split("."))
)


@HYPOTHESIS
@given(name=foreign_names, port=st.one_of(st.none(), st.integers(1, 65535)))
def test_a_loopback_server_refuses_every_other_host_name(loopback, name, port):
    """A DNS-rebinding page reaches 127.0.0.1 under its own name: refused on every path, the page's included."""
    host = name if port is None else f"{name}:{port}"
    for path in ("/health", "/v1/models", "/"):
        answer = loopback.get(path, headers={"host": host})
        assert answer.status_code == 403, (host, path)
        message = answer.json()["error"]["message"]
        assert "--allowed-hosts" in message and "\n" not in message and answer.json()["error"]["code"] == "host_not_allowed"


@HYPOTHESIS
@given(text=st.text(alphabet=string.printable.strip() + " ", max_size=60))
def test_any_host_text_is_read_or_refused_never_raises(text):
    """Whatever a stranger writes as Host, it is split or refused; what a loopback server accepts is loopback."""
    split = split_host(text)
    if split is not None and HostRule().allows(split[0]):
        assert split[0] == "localhost" or split[0].endswith(".localhost") or split[0] in ("::1", "::ffff:127.0.0.1") or split[0].startswith("127.") or split[0].startswith("::ffff:7f")


def test_loopback_names_and_addresses_are_served(loopback):
    for host in ("127.0.0.1:8000", "localhost:8000", "LOCALHOST", "localhost.", "[::1]:8000", "127.0.0.2", "app.localhost"):
        assert loopback.get("/health", headers={"host": host}).status_code == 200, host
    for host in ("127.0.0.1.nip.io", "localhost.evil.example", "[::1", "::1", "a b", "evil.example:99999"):
        assert loopback.get("/health", headers={"host": host}).status_code == 403, host


def test_allowed_hosts_widens_and_a_wide_bind_serves_addresses_and_this_machine(tmp_path):
    with _client(AccessSettings(allowed_hosts=("gpu.example.com", ".lab.example", "10.0.0.0/8"))) as client:
        for host, status in (("gpu.example.com", 200), ("a.lab.example:8000", 200), ("lab.example", 200),
                             ("10.1.2.3:8000", 200), ("192.168.1.5", 403), ("example.com", 403), ("localhost", 200)):  # fmt: skip
            assert client.get("/health", headers={"host": host}).status_code == status, host
    wide = AccessSettings(bind_host="0.0.0.0").hosts
    assert wide.allows("192.168.1.5") and wide.allows("203.0.113.7") and not wide.allows("evil.example")
    narrowed = AccessSettings(bind_host="0.0.0.0", allowed_hosts=("gpu.example.com",)).hosts
    assert narrowed.allows("gpu.example.com") and not narrowed.allows("192.168.1.5") and narrowed.allows("127.0.0.1")
    with pytest.raises(AccessSettingsError, match="allowed_hosts = 'http://x' is not valid"):
        AccessSettings(allowed_hosts=("http://x",))


def test_a_url_answer_names_an_allowed_host_only(loopback):
    """response_format=url links are built from the Host: one that passed the check, never a stranger's."""
    body = {"prompt": "a fox", "size": "64x64", "num_inference_steps": 1, "response_format": "url"}
    answer = loopback.post("/v1/images/generations", json=body, headers={"host": "localhost:8000"})
    assert answer.status_code == 200 and answer.json()["data"][0]["url"].startswith("http://localhost:8000/v1/images/outputs/")
    assert loopback.post("/v1/images/generations", json=body, headers={"host": "evil.example"}).status_code == 403


# --- Origin and CORS -------------------------------------------------------------------------------------------

origins = st.builds(
    lambda scheme, name, port: f"{scheme}://{name}" + (f":{port}" if port else ""),
    st.sampled_from(["http", "https"]), foreign_names, st.one_of(st.none(), st.integers(1, 65535)),
)


@HYPOTHESIS
@given(origin=origins, form=st.booleans())
def test_another_sites_page_cannot_queue_work(loopback, origin, form):
    """A cross-site form POST needs no preflight; its Origin refuses it before its body is read."""
    body = {"data": {"prompt": "x"}} if form else {"json": {"prompt": "x"}}
    answer = loopback.post("/v1/images/generations", headers={"origin": origin}, **body)
    assert answer.status_code == 403
    message = answer.json()["error"]["message"]
    assert repr(origin) in message and f"--allowed-origins {origin}" in message
    assert "access-control-allow-origin" not in answer.headers


@HYPOTHESIS
@given(origin=st.text(alphabet=string.printable.strip() + " ", max_size=60))
def test_any_origin_text_is_refused_or_passed_never_raises(loopback, origin):
    answer = loopback.post("/v1/images/generations", json={}, headers={"origin": origin})
    assert answer.status_code in (403, 422), (origin, answer.status_code)  # 422: it passed, the empty body did not
    if answer.status_code == 422:
        assert origin.strip().lower().rstrip("/") in ("http://127.0.0.1:8000",), origin


def test_the_servers_own_page_and_clients_without_origin_pass(loopback):
    body = {"prompt": "a fox", "size": "64x64", "num_inference_steps": 1}
    for headers in ({"origin": LOCAL}, {}, {"origin": "http://localhost:8000", "host": "localhost:8000"}):
        assert loopback.post("/v1/images/generations", json=body, headers=headers).status_code == 200, headers
    # another port of the same machine is another origin; "null" (a sandboxed frame, a file) is another site
    for origin in ("http://127.0.0.1:3000", "null", "http://127.0.0.1"):
        assert loopback.post("/v1/images/generations", json=body, headers={"origin": origin}).status_code == 403, origin
    assert loopback.get("/health", headers={"origin": "https://evil.example"}).status_code == 200  # reads: CORS's care
    assert "access-control-allow-origin" not in loopback.get("/health", headers={"origin": "https://evil.example"}).headers


def test_allowed_origins_may_write_and_read_with_cors():
    with _client(AccessSettings(allowed_origins=("HTTPS://App.Example:443",), api_key=KEY)) as client:
        preflight = client.options("/v1/images/generations", headers={
            "origin": "https://app.example", "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type",
        })  # fmt: skip
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "https://app.example"
        assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
        answer = client.post("/v1/images/generations", json={"prompt": "a", "size": "64x64", "num_inference_steps": 1},
                             headers={"origin": "https://app.example", "authorization": f"Bearer {KEY}"})  # fmt: skip
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "https://app.example"
        refused = client.get("/v1/models", headers={"origin": "https://app.example"})
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "https://app.example"
        other = client.post("/v1/images/generations", json={}, headers={"origin": "https://evil.example", "authorization": f"Bearer {KEY}"})
        assert other.status_code == 403 and "access-control-allow-origin" not in other.headers


# --- the API key -----------------------------------------------------------------------------------------------


def test_the_key_is_needed_on_the_api_and_not_on_health_metrics_or_the_page(keyed):
    for path in ("/v1/models", "/v1/images/jobs", "/v1/images/outputs/x"):
        answer = keyed.get(path)
        assert answer.status_code == 401 and answer.headers["www-authenticate"] == "Bearer", path
        message = answer.json()["error"]["message"]
        assert "Authorization: Bearer" in message and "--api-key" in message and "LAYERSTREAM_API_KEY" in message
        assert keyed.get(path, headers={"authorization": "Bearer wrong"}).status_code == 401
        assert keyed.get(path, headers={"authorization": f"Basic {KEY}"}).status_code == 401
        assert keyed.get(path, headers={"authorization": f"Bearer {KEY}"}).status_code != 401, path
    assert keyed.post("/v1/images/generations", json={"prompt": "x"}).status_code == 401
    for path in ("/health", "/metrics", "/", "/ui/app.js", "/openapi.json"):
        assert keyed.get(path).status_code == 200, path


def test_the_pages_cookie_opens_its_own_reads_only(keyed):
    """What a browser fetches without headers (the event stream, a video, a download) carries the page's cookie;
    a write never counts it, nor a read another site's page asked for."""
    cookie = {"cookie": f"other=1; layerstream_api_key={KEY}"}
    assert keyed.get("/v1/models", headers=cookie).status_code == 200
    assert keyed.get("/v1/models", headers={**cookie, "sec-fetch-site": "same-origin"}).status_code == 200
    for site in ("same-site", "cross-site"):
        assert keyed.get("/v1/models", headers={**cookie, "sec-fetch-site": site}).status_code == 401, site
    assert keyed.post("/v1/images/jobs", json={"prompt": "x"}, headers={**cookie, "origin": LOCAL}).status_code == 401
    assert keyed.get("/v1/models", headers={"cookie": "layerstream_api_key=wrong"}).status_code == 401


@HYPOTHESIS
@given(token=st.text(alphabet=string.printable.strip(), max_size=40))
def test_no_other_token_opens_the_api(keyed, token):
    if token != KEY:
        assert keyed.get("/v1/models", headers={"authorization": f"Bearer {token}"}).status_code == 401


def test_the_key_comes_from_the_flag_or_the_environment(monkeypatch):
    parse = lambda *argv: build_parser().parse_args(["serve", "tiny-flux", *argv])  # noqa: E731
    monkeypatch.setenv("LAYERSTREAM_API_KEY", "from-env")
    assert access_settings(parse(), "127.0.0.1").api_key == "from-env"
    assert access_settings(parse("--api-key", "from-flag"), "127.0.0.1").api_key == "from-flag"
    monkeypatch.delenv("LAYERSTREAM_API_KEY")
    assert access_settings(parse(), "127.0.0.1").api_key is None
    with pytest.raises(CliError, match=r"^--api-key \(or LAYERSTREAM_API_KEY\) is not valid"):
        access_settings(parse("--api-key", "has space"), "127.0.0.1")
    with pytest.raises(CliError, match=r"^--allowed-origins = 'evil.example' is not valid; expected an origin"):
        access_settings(parse("--allowed-origins", "evil.example"), "127.0.0.1")
    extension = access_settings(parse("--allowed-origins", "chrome-extension://abcdef"), "127.0.0.1")
    assert extension.origin_allowed("chrome-extension://abcdef") and not extension.origin_allowed("chrome-extension://other")
    settings = access_settings(parse("--allowed-hosts", "a.example,b.example", "--allowed-origins", "*"), "0.0.0.0")
    assert settings.allowed_hosts == ("a.example", "b.example") and settings.origin_allowed("https://any.example")


# --- /v1/models and --served-model-name ------------------------------------------------------------------------


def test_models_are_listed_in_openais_shape_and_name_what_a_request_may_carry():
    with _client(served_model_names=("wan-fast", "wan")) as client:
        listed = client.get("/v1/models").json()
        assert listed["object"] == "list" and [m["id"] for m in listed["data"]] == ["wan-fast", "wan"]
        assert {m["object"] for m in listed["data"]} == {"model"} and all(isinstance(m["created"], int) for m in listed["data"])
        assert client.get("/v1/models/wan").json()["id"] == "wan" and client.get("/v1/models/x").status_code == 404
        assert client.get("/health").json()["model"] == "wan-fast"
        body = {"prompt": "a fox", "size": "64x64", "num_inference_steps": 1}
        answer = client.post("/v1/images/generations", json={**body, "model": "wan"})
        assert answer.status_code == 200 and answer.json()["layerstream"]["model"] == "wan-fast"
        refused = client.post("/v1/images/generations", json={**body, "model": "stand-in"})
        assert refused.status_code == 400
        (detail,) = refused.json()["error"]["details"]
        assert detail["param"] == "model" and "'wan-fast' or 'wan'" in detail["allowed"] and "--served-model-name" in detail["allowed"]
    with pytest.raises(ServeSettingsError, match="served_model_names = ' x' is not valid"):
        ServeSettings(served_model_names=(" x",))


# --- no local path in an answer ---------------------------------------------------------------------------------


def test_health_names_a_folder_model_by_its_name_not_its_path(tmp_path: Path):
    folder = tmp_path / "wan-local"
    omni = StandInOmni()
    omni.source = ModelSource(str(folder), folder, "folder")
    omni.config = parse_offload_config({"mode": "layer", "components": ["dit"], "host_budget_gb": 1, "disk_dir": str(tmp_path / "spill")})
    service = GenerationService(omni, ServeSettings(port=0, shutdown_timeout=0))
    with TestClient(create_app(service, access=AccessSettings()), base_url=LOCAL) as client:
        health = client.get("/health")
        assert str(tmp_path) not in health.text and health.json()["offload_config"]["disk_dir"].startswith("set")
        assert health.json()["model"] == "wan-local" and health.json()["model_source"]["model"] == "wan-local"
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["wan-local"]


def test_an_os_error_reaches_a_client_without_its_path(tmp_path: Path):
    error = OSError(28, "No space left on device", str(tmp_path / "outputs" / "video_1.mp4"))
    line = client_line(error, {str(tmp_path): "--data-dir"})
    assert line == "OSError: No space left on device (in --data-dir)" and str(tmp_path) not in line
    assert client_line(RuntimeError(f"cannot read {tmp_path}/x\nmore"), {str(tmp_path): "--data-dir"}) == "RuntimeError: cannot read --data-dir/x"

