"""Who may drive `specmoe serve`: a web page in a browser may not (no CORS, Origin refused), a
DNS-rebinding Host is refused, an API key is enforced; /health and stats leak no paths. In-process
against the live app (embedded target, real queue and backend, the whole ASGI stack).
"""

from __future__ import annotations

import json

import pytest

from runtime.checkpoints import embedded_pair
from runtime.serve.security import AccessPolicy, Guard, is_loopback
from tests.serve_app import app_client, chat_body

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def client(engine):
    with app_client(engine) as c:
        yield c


@pytest.fixture(scope="module")
def keyed(engine):
    with app_client(engine, policy=AccessPolicy(api_key=KEY, cors_origins=("http://localhost:3000",))) as c:
        yield c


def _browser_post(client, origin: str):
    """What fetch() from a page at `origin` sends without a preflight: a text/plain POST."""
    return client.post("/v1/chat/completions", content=json.dumps(chat_body()),
                       headers={"Origin": origin, "Content-Type": "text/plain;charset=UTF-8"})


def _preflight(client, origin: str):
    return client.options("/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})


def test_a_cross_origin_browser_request_is_refused_and_gets_no_cors_headers(client, engine):
    r = _browser_post(client, "https://evil.example")
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in r.headers
    p = _preflight(client, "https://evil.example")
    assert p.status_code >= 400 and "access-control-allow-origin" not in p.headers
    assert client.post("/v1/chat/completions", json=chat_body()).status_code == 200  # no Origin: not a browser
    # The check is what refuses: with CORS for any origin (--cors-origin '*') the same page is served and can read it.
    with app_client(engine, policy=AccessPolicy(cors_origins=("*",))) as open_client:
        r = _browser_post(open_client, "https://evil.example")
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


def test_a_named_origin_gets_cors_and_others_still_do_not(keyed):
    p = _preflight(keyed, "http://localhost:3000")
    assert p.status_code == 200 and p.headers["access-control-allow-origin"] == "http://localhost:3000"
    r = keyed.post("/v1/chat/completions", json=chat_body(),
                   headers={"Origin": "http://localhost:3000", "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert _preflight(keyed, "http://localhost:3001").status_code == 403


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8080", "127.0.0.1.nip.io:8080", "localhost:9999",
                                  "127.0.0.1:80x"])
def test_a_rebinding_host_is_refused(client, host):
    headers = {"Host": host}
    for r in (client.get("/v1/specmoe/stats", headers=headers), client.get("/health", headers=headers),
              client.post("/v1/chat/completions", json=chat_body(), headers=headers)):
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", (host, r.text)


@pytest.mark.parametrize("host", ["localhost", "localhost:8080", "127.0.0.1", "127.0.0.1:8080", "[::1]:8080", "[::1]"])
def test_loopback_hosts_are_served(client, host):
    assert client.get("/health", headers={"Host": host}).status_code == 200


def test_the_host_check_is_what_refuses(engine, monkeypatch):
    """Planted: a policy that lets every Host through serves the rebinding request the test above refuses."""
    monkeypatch.setattr(AccessPolicy, "host_allowed", lambda self, host: True)
    with app_client(engine) as c:
        assert c.get("/v1/specmoe/stats", headers={"Host": "evil.example:8080"}).status_code == 200


def test_host_checks_apply_only_to_a_loopback_bind():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("[::1]") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.4") and not is_loopback("example.com")
    wide = AccessPolicy(bind_host="0.0.0.0")
    assert wide.host_allowed("my-mac.local:8080") and not AccessPolicy().host_allowed("my-mac.local:8080")


def test_the_api_key_is_enforced_on_every_route_but_health(keyed):
    body = chat_body()
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"x-api-key": "wrong"},
                    {"Authorization": f"Basic {KEY}"}):
        r = keyed.post("/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", headers
        assert keyed.get("/v1/models", headers=headers).status_code == 401
        assert keyed.get("/v1/specmoe/stats", headers=headers).status_code == 401
    assert keyed.get("/health").status_code == 200
    ok = keyed.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]
    assert keyed.post("/v1/chat/completions", json=body, headers={"x-api-key": KEY}).status_code == 200
    assert keyed.get("/v1/models", headers={"x-api-key": KEY}).json()["data"][0]["id"] == "tiny-target"


def test_the_key_check_is_what_refuses(engine, monkeypatch):
    """Planted: a policy whose key always matches serves the keyless request the test above refuses."""
    monkeypatch.setattr(AccessPolicy, "key_matches", lambda self, headers: True)
    with app_client(engine, policy=AccessPolicy(api_key=KEY)) as c:
        assert c.get("/v1/models").status_code == 200


def test_health_and_stats_name_no_paths_unless_a_key_holder_asks(client, keyed, engine):
    target = str(embedded_pair().target)
    assert client.post("/v1/chat/completions", json=chat_body()).status_code == 200
    for r in (client.get("/health"), client.get("/v1/specmoe/stats"), client.get("/v1/specmoe/stats?paths=1")):
        assert r.status_code == 200 and target not in r.text and "/work/" not in r.text and "/Users/" not in r.text
    auth = {"Authorization": f"Bearer {KEY}"}
    assert target not in keyed.get("/v1/specmoe/stats", headers=auth).text
    with_paths = keyed.get("/v1/specmoe/stats?paths=1", headers=auth).json()
    assert with_paths["paths"]["store"] == str(engine.model.store.model_dir)


def test_the_guard_reads_no_body():
    """Refusals happen before the body: the app below the guard is never called and receive() never awaited."""
    import asyncio

    sent = []

    async def app(scope, receive, send):
        raise AssertionError("the app ran")

    async def receive():
        raise AssertionError("the body was read")

    async def send(message):
        sent.append(message)

    for host in ([(b"host", b"evil.example")], []):  # a foreign Host, and none at all
        sent.clear()
        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
                 "headers": host + [(b"content-length", b"999999999")]}
        asyncio.run(Guard(app, AccessPolicy())(scope, receive, send))
        assert sent[0]["status"] == 403 and json.loads(sent[1]["body"])["error"]["code"] == "host_not_allowed"


def test_exposure_beyond_loopback_without_a_key_warns(tmp_path):
    from runtime.serve.server import ServeConfig, exposure_warning

    def config(**kw):
        return ServeConfig(model_ref="m", model_path=tmp_path, **kw)

    assert exposure_warning(config()) is None
    assert exposure_warning(config(host="0.0.0.0", api_key=KEY)) is None
    assert "WARNING: --host 0.0.0.0 exposes this server" in exposure_warning(config(host="0.0.0.0"))
    with pytest.raises(ValueError, match="--api-key is empty"):
        AccessPolicy(api_key="  ")
    with pytest.raises(ValueError, match="--cors-origin 'localhost:3000'; expected an origin as browsers send it"):
        config(cors_origins=("localhost:3000",))  # checked when the config is made, before the model loads
