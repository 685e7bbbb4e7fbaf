"""The request bodies `pof router` reads, for its OpenAPI schema (``/openapi.json``, ``/docs``).

Documentation only: the proxy forwards each body unchanged and does not validate it against
these models (the engine does); the fields named here are the ones the router itself reads to
route a request. Every other field of the OpenAI API (``temperature``, ``n``, ``logprobs``, ...)
is allowed and passed through (``additionalProperties``).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

TokenId = Annotated[int, Field(ge=0, le=0xFFFFFFFF)]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class CompletionRequest(_Open):
    model: str | None = Field(None, description="the served model name, passed to the engine")
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]] = Field(
        description="text, token ids (integers in 0..2^32-1), or a batch of either; the router routes on "
                    "the (first) prompt's tokens")
    cache_salt: str | None = Field(None, description="the tenant's cache salt: only pages stored with the same "
                                                     "salt count for routing")
    stream: bool | None = Field(None, description="stream the answer as server-sent events")
    max_tokens: int | None = Field(None, ge=0, description="tokens to generate (the engine's own default: None)")


class ContentPart(_Open):
    type: str = Field(description="'text', 'image_url', ...; the router reads the text of 'text' parts")
    text: str | None = None


class ChatMessage(_Open):
    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(_Open):
    model: str | None = Field(None, description="the served model name, passed to the engine")
    messages: list[ChatMessage] = Field(description="the conversation; tokenized (chat template included) by a "
                                                    "backend's /tokenize to route on it")
    cache_salt: str | None = Field(None, description="the tenant's cache salt: only pages stored with the same "
                                                     "salt count for routing")
    stream: bool | None = Field(None, description="stream the answer as server-sent events")
    max_tokens: int | None = Field(None, ge=0, description="tokens to generate (the engine's own default: None)")


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: int


class ErrorAnswer(BaseModel):
    """The OpenAI-style error the router answers itself (a backend's own errors pass unchanged)."""

    error: ErrorDetail


BODIES: dict[str, type[BaseModel]] = {"/v1/completions": CompletionRequest,
                                      "/v1/chat/completions": ChatCompletionRequest}
ERRORS = {"400": "not a JSON object, nested too deeply, or token ids out of range",
          "408": "the body did not all arrive within read_timeout_s",
          "413": "the body is over max_body_bytes",
          "503": "no healthy backend"}


def document(app: FastAPI) -> None:
    """Give ``app``'s OpenAPI schema the request bodies of :data:`BODIES` and the router's errors
    (its handlers read the raw body, so FastAPI cannot derive them)."""
    plain = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = plain()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        models: list[type[BaseModel]] = [*BODIES.values(), ErrorAnswer]
        for model in models:
            found = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(found.pop("$defs", {}))
            components[model.__name__] = found
        error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorAnswer"}}}}
        for path, model in BODIES.items():
            op = schema["paths"][path]["post"]
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
            op["responses"].update({status: {"description": why, **error} for status, why in ERRORS.items()})
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
