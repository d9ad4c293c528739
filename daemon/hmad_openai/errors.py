"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the HTTP status that fits.

``from_exception`` maps what hmaclient raises (the daemon's error codes, an unreachable daemon, a request
refused before it was sent) onto them:

    bad_request, too_large, prompt_too_long, ProtocolError   400 invalid_request_error
    unsupported (the model cannot do what was asked, e.g.    400 invalid_request_error
    images on a model without a vision tower)
    busy                                                     429 rate_limit_error (clients retry)
    model_not_found (a model named that is not on disk)       404 invalid_request_error
    switch_refused (hmad does not switch models per request)  400 invalid_request_error
    shutting_down, loading, no_model, hmad unreachable       503 service_unavailable
    lost the connection while the request ran               502 server_error
    unsupported_version, unknown_type                        502 server_error (gateway and hmad disagree)
    internal and anything else                               500 server_error
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from hmaclient import protocol as P
from hmaclient.errors import ConnectionLost, DaemonUnreachable, HmadTimeout, RequestError

INVALID = "invalid_request_error"
SERVER = "server_error"

_BY_CODE: dict[str, tuple[int, str]] = {
    P.BAD_REQUEST: (400, INVALID),
    P.TOO_LARGE: (400, INVALID),
    P.PROMPT_TOO_LONG: (400, INVALID),
    P.UNSUPPORTED: (400, INVALID),  # e.g. images sent to a model without a vision tower
    P.BUSY: (429, "rate_limit_error"),
    P.SHUTTING_DOWN: (503, "service_unavailable"),
    P.LOADING: (503, "service_unavailable"),  # a daemon that answers while its model loads
    P.NO_MODEL: (503, "service_unavailable"),  # its model failed to load; hmactl load one
    P.MODEL_NOT_FOUND: (404, INVALID),
    P.SWITCH_REFUSED: (400, INVALID),
    P.UNSUPPORTED_VERSION: (502, SERVER),
    P.UNKNOWN_TYPE: (502, SERVER),
}
# hmad's codes as OpenAI names them where OpenAI has a name for the same thing.
_OPENAI_CODE = {P.PROMPT_TOO_LONG: "context_length_exceeded"}


class OpenAIError(Exception):
    """An error answer: HTTP ``status`` and the body's fields."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = INVALID,
        code: str | None = None,
        param: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, INVALID, code, param)


def from_exception(e: Exception) -> OpenAIError:
    """The OpenAI error for what talking to hmad raised (OpenAIError passes through)."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, P.ProtocolError):  # refused by hmaclient before anything was sent
        return bad_request(e.message, _param_of(e.message), e.code)
    if isinstance(e, RequestError):
        status, kind = _BY_CODE.get(e.code, (500, SERVER))
        return OpenAIError(status, f"hmad: {e.message}", kind, _OPENAI_CODE.get(e.code, e.code))
    if isinstance(e, ConnectionLost):
        return OpenAIError(502, str(e), SERVER, "hmad_connection_lost")
    if isinstance(e, DaemonUnreachable):
        return OpenAIError(503, str(e), "service_unavailable", "hmad_unreachable")
    if isinstance(e, HmadTimeout):
        return OpenAIError(504, str(e), SERVER, "timeout")
    return OpenAIError(500, f"internal error: {type(e).__name__}: {e}", SERVER, "internal")


def _param_of(message: str) -> str | None:
    """The request field a hmaclient message names first ("temperature must be ...")."""
    word = message.split(" ", 1)[0]
    return word if word.replace("_", "").isalpha() and word.islower() else None
