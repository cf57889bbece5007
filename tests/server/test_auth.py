"""API keys (constant-time, every non-public path), their configuration, and CORS."""

from __future__ import annotations

import hmac

import pytest

from server.auth import APIKeyMiddleware
from server.config import ServingConfig

KEYS = ("sk-first-key", "sk-second-key")
PROTECTED = [
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("GET", "/v1/models", None),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [5, 6]}),
    ("GET", "/version", None),
    ("GET", "/openapi.json", None),
    ("GET", "/no/such/route", None),
]


def assert_401(r) -> None:  # noqa: ANN001
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"
    body = r.json()
    assert body == {
        "error": {
            "message": "Missing or invalid API key: send it as 'Authorization: Bearer <key>'.",
            "type": "authentication_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }


@pytest.mark.parametrize(("method", "path", "body"), PROTECTED)
async def test_every_route_needs_a_key(serve, method: str, path: str, body) -> None:  # noqa: ANN001
    s = await serve(api_keys=KEYS)
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "Bearer "},
        {"Authorization": f"Basic {KEYS[0]}"},
        {"Authorization": f"Bearer {KEYS[0]}x"},
        {"Authorization": f"Bearer {KEYS[0][:-1]}"},
    ):
        assert_401(await s.http.request(method, path, json=body, headers=headers))
    assert s.engine.added == []  # nothing reached the engine
    for key in KEYS:
        r = await s.http.request(
            method, path, json=body, headers={"Authorization": f"bearer {key}"}
        )
        assert r.status_code != 401, r.text


async def test_health_and_metrics_are_open_by_default_and_configurable(serve) -> None:
    s = await serve(api_keys=KEYS)
    assert (await s.http.get("/health")).status_code == 200
    assert (await s.http.get("/metrics")).status_code == 200
    closed = await serve(api_keys=KEYS, public_paths=())
    assert_401(await closed.http.get("/health"))
    assert_401(await closed.http.get("/metrics"))
    ok = await closed.http.get("/health", headers={"Authorization": f"Bearer {KEYS[1]}"})
    assert ok.status_code == 200


async def test_no_keys_means_no_auth(serve) -> None:
    s = await serve()
    r = await s.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200


async def test_an_unauthenticated_body_is_never_read(serve) -> None:
    """Authentication comes before the body: a huge body without a key gets a 401, not a
    413, and is not buffered."""
    s = await serve(api_keys=KEYS, max_body_bytes=1000)
    r = await s.http.post("/v1/completions", content=b"x" * 100_000)
    assert_401(r)


def test_keys_are_compared_in_constant_time_against_every_key(monkeypatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr("server.auth.hmac.compare_digest", spy)
    middleware = APIKeyMiddleware(app=None, api_keys=KEYS, public_paths=())  # type: ignore[arg-type]
    for token, valid in ((b"sk-first-key", True), (b"sk-second-key", True), (b"nope", False)):
        calls.clear()
        assert middleware.is_valid(token) is valid
        # Digests of equal length, compared with every key even after a match.
        assert len(calls) == len(KEYS)
        assert all(len(a) == len(b) == 32 for a, b in calls)
    calls.clear()
    assert middleware.is_valid(None) is False


def test_keys_from_flags_and_the_environment() -> None:
    parse = ServingConfig.from_cli
    assert parse([]).server.api_keys == ()
    assert parse(["--api-key", "a,b"]).server.api_keys == ("a", "b")
    assert parse(["--api-key", "a", "--api-key", "b"]).server.api_keys == ("a", "b")
    env = {"PAGEDSERVE_API_KEY": "e1, e2"}
    assert parse([], env).server.api_keys == ("e1", "e2")
    # A flag replaces the environment's keys rather than adding to them.
    assert parse(["--api-key", "f"], env).server.api_keys == ("f",)
    assert parse(["--public-paths", ""]).server.public_paths == ()
    assert parse(["--cors-origins", "https://a.example,https://b.example"]).server.cors_origins == (
        "https://a.example",
        "https://b.example",
    )
    config = parse(["--api-key", "sk-secret-value"])
    assert "sk-secret-value" not in repr(config)


def test_a_malformed_key_is_refused_without_printing_it(capsys) -> None:
    with pytest.raises(SystemExit):
        ServingConfig.from_cli(["--api-key", "good,has space"])
    err = capsys.readouterr().err
    assert "API key #2" in err and "has space" not in err


async def test_cors_is_off_by_default(serve) -> None:
    s = await serve()
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    r = await s.http.options("/v1/completions", headers=preflight)
    assert "access-control-allow-origin" not in r.headers
    r = await s.http.get("/health", headers={"Origin": "https://app.example"})
    assert "access-control-allow-origin" not in r.headers


async def test_cors_origins_allow_a_browser_client_with_a_key(serve) -> None:
    s = await serve(api_keys=KEYS, cors_origins=("https://app.example",))
    preflight = {
        "Origin": "https://app.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    r = await s.http.options("/v1/completions", headers=preflight)
    assert r.status_code == 200  # answered before authentication: preflights carry no key
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    r = await s.http.post(
        "/v1/completions",
        json={"prompt": "hi", "max_tokens": 2},
        headers={"Origin": "https://app.example", "Authorization": f"Bearer {KEYS[0]}"},
    )
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    other = await s.http.options(
        "/v1/completions", headers={**preflight, "Origin": "https://evil.example"}
    )
    assert "access-control-allow-origin" not in other.headers
