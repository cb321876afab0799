"""The server's endpoints in one table, and GET /openapi.json built from it:
an OpenAPI 3.1 document whose request bodies are the pydantic models'
JSON schemas, so the description cannot drift from what is validated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from pagoda.entrypoints.openai.protocol import ErrorResponse

_REF = "#/components/schemas/{model}"
_ERRORS = {400: "Bad request: invalid JSON, fields or values, or an unsupported feature",
           401: "Missing or wrong API key (when the server has one)",
           404: "Unknown model", 413: "Body too large", 415: "Content-Type is not application/json",
           503: "The engine died, or (generation) --max-queued-requests requests wait: retry after Retry-After "
                "seconds (on /health: it died or has not finished a step for too long while requests are pending)"}


@dataclass(frozen=True)
class Endpoint:
    path: str
    method: str
    handler: Callable
    summary: str
    ok: str  # what a 200 holds
    requests: tuple[type[BaseModel], ...] = ()  # body schemas (several: any one of them)
    responses: tuple[type[BaseModel], ...] = ()  # 200 body schemas, where one is defined
    errors: tuple[int, ...] = ()
    content_types: tuple[str, ...] = ("application/json",)
    keyed: bool = False  # needs the API key when the server has one


def openapi_schema(endpoints: list[Endpoint], title: str, version: str, api_key: bool) -> dict:
    models = {m for e in endpoints for m in e.requests + e.responses} | {ErrorResponse}
    _, defs = models_json_schema([(m, "validation") for m in sorted(models, key=lambda m: m.__name__)],
                                 ref_template=_REF)
    paths: dict[str, dict] = {}
    for e in endpoints:
        content: dict = {t: {} for t in e.content_types}
        if e.responses:
            content["application/json"] = dict(schema=_one_of(e.responses))
        op: dict = dict(summary=e.summary, operationId=_operation_id(e),
                        responses={"200": dict(description=e.ok, content=content)})
        if e.requests:
            op["requestBody"] = dict(required=True, content={"application/json": dict(schema=_one_of(e.requests))})
        for status in e.errors + ((401,) if e.keyed and api_key else ()):
            op["responses"][str(status)] = dict(description=_ERRORS[status], content={
                "application/json": dict(schema={"$ref": _REF.format(model="ErrorResponse")})})
        if e.keyed and api_key:
            op["security"] = [{"bearer": []}]
        paths.setdefault(e.path, {})[e.method.lower()] = op
    components: dict = dict(schemas=defs.get("$defs", {}))
    if api_key:
        components["securitySchemes"] = dict(bearer=dict(type="http", scheme="bearer"))
    return dict(openapi="3.1.0", info=dict(title=title, version=version), paths=paths, components=components)


def _one_of(models: tuple[type[BaseModel], ...]) -> dict:
    refs = [{"$ref": _REF.format(model=m.__name__)} for m in models]
    return refs[0] if len(refs) == 1 else {"oneOf": refs}


def _operation_id(e: Endpoint) -> str:
    return e.method.lower() + "_" + (e.path.strip("/").replace("/", "_").replace(".", "_") or "root")
