"""What the app does around the endpoints: /openapi.json describes every
route, CORS answers preflights for --allowed-origins only, and the access
log writes at most one line per request (none when turned off)."""

import logging

import httpx
import pytest

from conftest import ENGINE_ARGS, MODEL, RunningServer, post


def test_openapi_describes_every_route(server):
    doc = httpx.get(server.url + "/openapi.json").json()
    assert doc["openapi"].startswith("3.1") and doc["info"]["title"] == "Pagoda"
    routes = [(route.path, method) for route in server.app.routes for method in route.methods - {"HEAD"}]
    assert len(routes) >= 9
    for path, method in routes:
        assert method.lower() in doc["paths"].get(path, {}), (path, method)
        assert "200" in doc["paths"][path][method.lower()]["responses"]
    schemas = doc["components"]["schemas"]
    completions = doc["paths"]["/v1/completions"]["post"]
    assert completions["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/CompletionRequest"}
    assert {"prompt", "max_tokens", "return_timings"} <= set(schemas["CompletionRequest"]["properties"])
    assert completions["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("ErrorResponse")
    tokenize = doc["paths"]["/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {ref["$ref"].rsplit("/", 1)[1] for ref in tokenize["oneOf"]} == {"TokenizeCompletionRequest",
                                                                          "TokenizeChatRequest"}
    # Every reference resolves.
    refs = set()

    def collect(node):
        if isinstance(node, dict):
            refs.update(v for k, v in node.items() if k == "$ref")
            for v in node.values():
                collect(v)
        elif isinstance(node, list):
            for v in node:
                collect(v)

    collect(doc)
    assert refs and all(ref.rsplit("/", 1)[1] in schemas for ref in refs)
    assert "securitySchemes" not in doc["components"]  # no --api-key


def preflight(server, origin):
    return httpx.options(server.url + "/v1/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})


@pytest.fixture(scope="module")
def cors_server(model_folder):
    from pagoda.engine.async_llm import AsyncLLM

    running = RunningServer(AsyncLLM(model_folder, disable_log_stats=True, **ENGINE_ARGS), MODEL,
                            allowed_origins=["http://app.example"], log_requests=True)
    yield running
    running.stop()


def test_cors(cors_server, server):
    r = preflight(cors_server, "http://app.example")
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert preflight(cors_server, "http://evil.example").status_code == 400
    r = httpx.get(cors_server.url + "/v1/models", headers={"Origin": "http://app.example"})
    assert r.headers["access-control-allow-origin"] == "http://app.example"
    # Without --allowed-origins: no CORS at all.
    assert preflight(server, "http://app.example").status_code == 405
    assert "access-control-allow-origin" not in httpx.get(server.url + "/v1/models",
                                                           headers={"Origin": "http://app.example"}).headers


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def server_log():
    logger, handler = logging.getLogger("pagoda.server"), Lines()
    logger.addHandler(handler)
    yield handler.lines
    logger.removeHandler(handler)


def requests(server):
    assert post(server, "/v1/completions", {"model": MODEL, "prompt": [5], "max_tokens": 2}).status_code == 200
    assert post(server, "/v1/completions", {"model": MODEL, "prompt": [5], "temperature": -1}).status_code == 400
    with httpx.stream("POST", server.url + "/v1/completions",
                      json={"model": MODEL, "prompt": [5], "max_tokens": 3, "stream": True}) as r:
        r.read()
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_one_access_line_per_request(cors_server, server_log):
    requests(cors_server)
    assert len(server_log) == 3, server_log  # monitoring polls are not logged
    assert [line.split()[:3] for line in server_log] == [["POST", "/v1/completions", "200"],
                                                         ["POST", "/v1/completions", "400"],
                                                         ["POST", "/v1/completions", "200"]]


def test_no_access_lines_when_off(server, server_log):
    requests(server)  # built with log_requests=False (--disable-log-requests)
    assert server_log == []
