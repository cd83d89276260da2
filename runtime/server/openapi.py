"""The server's OpenAPI document (GET /openapi.json), with the request bodies the routes parse.

The completion routes read their body themselves (runtime/server/app.py: the size limit comes
before the parse, and the parse runs off the event loop), so FastAPI cannot see their schemas.
This module puts them back: the JSON schema pydantic derives from each request model
(runtime/server/protocol.py: the same fields, bounds and required keys the parser enforces) is
added under components/schemas and referenced from the route's requestBody. Clients and
property-based tests (tests/server/test_server_edges.py drives it with schemathesis) read it.

1. `body_spec(model)`: the `openapi_extra` of a route whose body is `model`.
2. `install(app, models)`: app.openapi returns FastAPI's document with the models' schemas added.

It does not validate anything (protocol.py does) and documents no response bodies.
"""

from __future__ import annotations

from fastapi.openapi.utils import get_openapi

__all__ = ["body_spec", "install"]

REF = "#/components/schemas/{model}"


def body_spec(model) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": REF.format(model=model.__name__)}}}}}


def install(app, models) -> None:
    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                schema = model.model_json_schema(ref_template=REF)
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
