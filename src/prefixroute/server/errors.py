"""Error responses in the shapes the official clients understand.

* OpenAI routes: ``{"error": {"message", "type", "param", "code"}}`` (what the
  ``openai`` client turns into ``BadRequestError``, ``NotFoundError``...).
* SageMaker runtime routes (rest-json protocol, as botocore parses it): the error code
  in the ``x-amzn-ErrorType`` header, the message in the body's ``message``; modeled
  fields (``ModelError``'s ``OriginalStatusCode``, ``OriginalMessage``) in the body.
  boto3 then raises ``client.exceptions.ValidationError``, ``ModelError``...
"""

from __future__ import annotations

from typing import Any, Mapping

import orjson
from aiohttp import web

__all__ = ["json_response", "openai_error", "sagemaker_error", "SAGEMAKER_ERROR_STATUS", "MAX_ERROR_BODY"]

#: Characters of a model's error body kept (SageMaker's ``ModelError.OriginalMessage``);
#: up to 4 bytes a character are read for them.
MAX_ERROR_BODY = 8192

#: SageMaker runtime error codes and their HTTP status (botocore's sagemaker-runtime model).
SAGEMAKER_ERROR_STATUS = {
    "ValidationError": 400,
    "ModelNotReadyException": 429,
    "ModelError": 424,
    "InternalFailure": 500,
    "ServiceUnavailable": 503,
}


def json_response(status: int, data: Any, headers: Mapping[str, str] | None = None) -> web.Response:
    """A JSON response serialised with orjson."""
    resp = web.Response(status=status, body=orjson.dumps(data), content_type="application/json")
    if headers:
        resp.headers.update(headers)
    return resp


def openai_error(
    status: int,
    message: str,
    *,
    type_: str = "invalid_request_error",
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> web.Response:
    """An OpenAI-shaped error (``param`` is always null)."""
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return json_response(status, body, headers)


def sagemaker_error(
    error_type: str,
    message: str,
    *,
    status: int | None = None,
    extra: Mapping[str, Any] | None = None,
    headers: Mapping[str, str] | None = None,
) -> web.Response:
    """A SageMaker-runtime-shaped error.

    Args:
        error_type: ``ValidationError``, ``ModelError``, ``ServiceUnavailable``...
        message: the human-readable message (never prompt text).
        status: HTTP status; default from :data:`SAGEMAKER_ERROR_STATUS`.
        extra: modeled fields of the error shape, e.g. ``OriginalStatusCode``.
    """
    body: dict[str, Any] = {"message": message}
    if extra:
        body.update(extra)
    resp = json_response(status or SAGEMAKER_ERROR_STATUS.get(error_type, 500), body, headers)
    resp.headers["x-amzn-ErrorType"] = error_type
    return resp
