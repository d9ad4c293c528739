"""Images through hmad-openai: OpenAI chat (image_url parts), the Responses API (input_image), Anthropic
(image blocks) and Ollama (images), through the official ``openai``, ``anthropic`` and ``ollama`` clients
and raw HTTP against a real gateway in front of a real hmad (gateway_harness.py).

Each API's image reaches hmad as the bytes hmaclient sends for the same request (the gateway's answer equals
hmaclient's, an error included); the tiny model has no vision tower, so hmad refuses an image with a 400
that says so. Remote URLs, bad base64, bad data: URIs, other media types and images outside user turns are
400s naming the problem, before hmad is asked.
"""

from __future__ import annotations

import base64
import io
import json

import anthropic
import gateway_harness as harness
import httpx
import ollama
import openai
import pytest
from gateway_harness import FUZZ, KEY, assert_serving, malformed
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from hmaclient import Client, RequestError
from hmaclient import protocol as P
from hmad_openai.anthropic_schema import MessagesBody
from hmad_openai.errors import OpenAIError
from hmad_openai.ollama_schema import ChatBody, GenerateBody
from hmad_openai.responses_schema import ResponsesBody
from hmad_openai.schema import ChatRequest

daemon, gateway, hmad = harness.daemon, harness.gateway, harness.hmad  # the module's fixtures


def _png(color: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), color).save(buf, "PNG")
    return buf.getvalue()


PNG, PNG2 = _png((255, 0, 0)), _png((0, 0, 255))
B64 = base64.b64encode(PNG).decode()
DATA_URI = "data:image/png;base64," + B64
GREEDY = {"temperature": 0, "max_tokens": 4}
HMAD_PARTS = [
    {"type": "text", "text": "what is"},
    {"type": "image", "image": PNG},
    {"type": "text", "text": "this?"},
]
HMAD_MESSAGES = [{"role": "user", "content": HMAD_PARTS}]
VISION = ("image", "vision")  # a refusal of images by a model without vision names one of these


@pytest.fixture
def oai(gateway):
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture
def claude(gateway):
    return anthropic.Anthropic(base_url=gateway.url, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture
def olla(gateway):
    return ollama.Client(host=gateway.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


@pytest.fixture
def http(gateway):
    headers = {"Authorization": f"Bearer {KEY}", "x-api-key": KEY, "anthropic-version": "2023-06-01"}
    with httpx.Client(base_url=gateway.url, headers=headers, timeout=60) as h:
        yield h


def _ref(socket: str, **kw) -> str | RequestError:
    """hmaclient's answer to the same request: its text, or the error hmad answered."""
    with Client(socket) as c:
        try:
            return c.generate(**kw).text
        except RequestError as e:
            return e


def _openai_parts(url: str = DATA_URI) -> list[dict]:
    image = {"type": "image_url", "image_url": {"url": url, "detail": "low"}}
    return [{"type": "text", "text": "what is"}, image, {"type": "text", "text": "this?"}]


# -- what hmad says of an image on a model without vision ------------------------------------------------


def test_a_model_without_vision_refuses_an_image_with_a_400_that_says_so(oai, hmad):
    """hmad's own answer (``unsupported`` once its image side is in; ``bad_request`` is taken too), and the
    gateway's 400 carrying it."""
    ref = _ref(hmad.socket, messages=HMAD_MESSAGES, **GREEDY)
    assert isinstance(ref, RequestError), f"hmad answered an image on a model without vision: {ref!r}"
    assert ref.code in (P.UNSUPPORTED, P.BAD_REQUEST) and any(w in ref.message.lower() for w in VISION), ref
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="any", messages=[{"role": "user", "content": _openai_parts()}])
    assert info.value.status_code == 400 and ref.message in info.value.message
    assert info.value.body["type"] == "invalid_request_error"


# -- each API's image reaches hmad as hmaclient sends it -------------------------------------------------


def _same(ref: str | RequestError, status: int, text: str | None, message: str | None) -> None:
    """The gateway's answer (status, its text or its error message) is hmaclient's ``ref``."""
    if isinstance(ref, RequestError):
        assert status == 400 and message is not None and ref.message in message, (status, message, ref)
    else:
        assert status == 200 and text == ref, (status, text, ref)


def test_openai_chat_image_url_equals_hmaclient(oai, hmad):
    ref = _ref(hmad.socket, messages=HMAD_MESSAGES, **GREEDY)
    try:
        r = oai.chat.completions.create(
            model="any", messages=[{"role": "user", "content": _openai_parts()}], **GREEDY
        )
        _same(ref, 200, r.choices[0].message.content, None)
    except openai.BadRequestError as e:
        _same(ref, e.status_code, None, e.message)


def test_responses_input_image_equals_hmaclient(oai, hmad):
    ref = _ref(hmad.socket, messages=HMAD_MESSAGES, **GREEDY)
    content = [
        {"type": "input_text", "text": "what is"},
        {"type": "input_image", "image_url": DATA_URI, "detail": "auto"},
        {"type": "input_text", "text": "this?"},
    ]
    try:
        r = oai.responses.create(
            model="any", input=[{"role": "user", "content": content}], max_output_tokens=4, temperature=0
        )
        _same(ref, 200, r.output_text, None)
    except openai.BadRequestError as e:
        _same(ref, e.status_code, None, e.message)


def test_anthropic_image_block_equals_hmaclient(claude, hmad):
    ref = _ref(hmad.socket, messages=HMAD_MESSAGES, **GREEDY)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64}}
    content = [{"type": "text", "text": "what is"}, image, {"type": "text", "text": "this?"}]
    try:
        r = claude.messages.create(
            model="any",
            messages=[{"role": "user", "content": content}],
            max_tokens=4,
            extra_body={"temperature": 0},
        )
        _same(ref, 200, r.content[0].text, None)
    except anthropic.BadRequestError as e:
        assert e.body["type"] == "error" and e.body["error"]["type"] == "invalid_request_error"
        _same(ref, e.status_code, None, e.body["error"]["message"])


def test_ollama_chat_and_generate_images_equal_hmaclient(olla, hmad):
    """Ollama's images go before the message's text (the ollama client base64-encodes bytes)."""
    parts = [
        {"type": "image", "image": PNG},
        {"type": "image", "image": PNG2},
        {"type": "text", "text": "what?"},
    ]
    ref = _ref(hmad.socket, messages=[{"role": "user", "content": parts}], **GREEDY)
    options = {"temperature": 0, "num_predict": 4}
    message = {"role": "user", "content": "what?", "images": [PNG, PNG2]}
    try:
        r = olla.chat(model="any", messages=[message], options=options, stream=False)
        _same(ref, 200, r.message.content, None)
    except ollama.ResponseError as e:
        _same(ref, e.status_code, None, e.error)
    ref = _ref(hmad.socket, prompt="what?", images=[PNG], **GREEDY)
    try:
        r = olla.generate(model="any", prompt="what?", images=[PNG], options=options, stream=False)
        _same(ref, 200, r.response, None)
    except ollama.ResponseError as e:
        _same(ref, e.status_code, None, e.error)


def test_streamed_requests_with_images_are_refused_before_the_stream_when_hmad_refuses(oai, http, hmad):
    ref = _ref(hmad.socket, messages=HMAD_MESSAGES, **GREEDY)
    if not isinstance(ref, RequestError):
        pytest.skip("hmad answers images (a model with vision): nothing is refused")
    body = {"model": "any", "messages": [{"role": "user", "content": _openai_parts()}], "stream": True}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and ref.message in r.json()["error"]["message"]
    r = http.post(
        "/api/chat", json={"model": "any", "messages": [{"role": "user", "content": "x", "images": [B64]}]}
    )
    assert r.status_code == 400 and ref.message in r.json()["error"]


# -- refused by the gateway, naming the problem -----------------------------------------------------------


def _chat(content, role: str = "user") -> dict:
    return {"model": "any", "messages": [{"role": role, "content": content}]}


@pytest.mark.parametrize(
    ("path", "body", "says"),
    [
        (
            "/v1/chat/completions",
            _chat(_openai_parts("https://example.com/cat.png")),
            "remote image URLs are not fetched",
        ),
        (
            "/v1/chat/completions",
            _chat(_openai_parts("http://example.com/cat.png")),
            "send the image inline as a data: URI",
        ),
        ("/v1/chat/completions", _chat(_openai_parts("data:image/png;base64,%%%")), "not valid base64"),
        (
            "/v1/chat/completions",
            _chat(_openai_parts("data:image/png;base64,aGVsbG8=")),
            "decoded image is 5 bytes",
        ),
        ("/v1/chat/completions", _chat(_openai_parts("data:image/png;base64,")), "decoded image is empty"),
        (
            "/v1/chat/completions",
            _chat(_openai_parts("data:text/plain;base64," + B64)),
            "media type 'text/plain'",
        ),
        (
            "/v1/chat/completions",
            _chat(_openai_parts("data:image/svg+xml;base64," + B64)),
            "media type 'image/svg+xml'",
        ),
        ("/v1/chat/completions", _chat(_openai_parts("data:image/png," + B64)), "must be base64"),
        ("/v1/chat/completions", _chat(_openai_parts("data:image/png;base64")), "','"),
        ("/v1/chat/completions", _chat(_openai_parts("cat.png")), "must be a data: URI"),
        ("/v1/chat/completions", _chat([{"type": "image_url"}]), "image_url.url must be a string"),
        (
            "/v1/chat/completions",
            _chat([{"type": "input_audio", "input_audio": {}}]),
            "only text and image_url parts are supported, got type 'input_audio'",
        ),
        (
            "/v1/chat/completions",
            _chat(_openai_parts(), role="assistant"),
            "only user messages may hold images",
        ),
        ("/v1/chat/completions", _chat(_openai_parts(), role="system"), "only user messages may hold images"),
        (
            "/v1/responses",
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]},
            "file_id is not supported",
        ),
        (
            "/v1/responses",
            {
                "input": [
                    {
                        "role": "user",
                        "content": [{"type": "input_image", "image_url": "https://example.com/a.png"}],
                    }
                ]
            },
            "remote image URLs are not fetched",
        ),
        (
            "/v1/responses",
            {"input": [{"role": "assistant", "content": [{"type": "input_image", "image_url": DATA_URI}]}]},
            "only user messages may hold images",
        ),
        (
            "/v1/responses",
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "only text and input_image parts",
        ),
        (
            "/v1/messages",
            {
                "max_tokens": 2,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
                        ],
                    }
                ],
            },
            "remote image URLs are not fetched",
        ),
        (
            "/v1/messages",
            {
                "max_tokens": 2,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {"type": "base64", "media_type": "image/tiff", "data": B64},
                            }
                        ],
                    }
                ],
            },
            "media type 'image/tiff'",
        ),
        (
            "/v1/messages",
            {
                "max_tokens": 2,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {"type": "base64", "media_type": "image/png", "data": "@@"},
                            }
                        ],
                    }
                ],
            },
            "not valid base64",
        ),
        (
            "/v1/messages",
            {
                "max_tokens": 2,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}],
                    }
                ],
            },
            "image blocks need a source",
        ),
        (
            "/api/chat",
            {"model": "any", "messages": [{"role": "assistant", "content": "x", "images": [B64]}]},
            "only user messages may hold images",
        ),
        (
            "/api/chat",
            {"model": "any", "messages": [{"role": "user", "content": "x", "images": ["not base64!"]}]},
            "messages[0].images[0]: the image is not valid base64",
        ),
        (
            "/api/generate",
            {"model": "any", "prompt": "x", "raw": True, "images": [B64]},
            "images need the chat template",
        ),
        (
            "/api/generate",
            {"model": "any", "prompt": "x", "images": [base64.b64encode(b"GIF8").decode()]},
            "images[0]: the decoded image is 4 bytes",
        ),
        (
            "/api/generate",
            {"model": "any", "prompt": "x", "images": [B64] * (P.MAX_IMAGES + 1)},
            "images is over the limit of 16",
        ),
    ],
)
def test_bad_images_are_400s_naming_the_problem(http, hmad, path, body, says):
    r = http.post(path, json={"model": "any", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    message = error if isinstance(error, str) else error["message"]
    assert says in message, message
    if path.startswith("/v1/messages"):
        assert r.json()["type"] == "error" and error["type"] == "invalid_request_error"
    elif path.startswith("/v1/"):
        assert error["type"] == "invalid_request_error"


def test_the_openai_client_sees_a_remote_url_refused(oai, hmad):
    parts = _openai_parts("https://example.com/cat.png")
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="any", messages=[{"role": "user", "content": parts}])
    assert "remote image URLs are not fetched" in info.value.message and "data: URI" in info.value.message


def test_a_body_of_images_up_to_the_frame_limit_is_read(http, hmad):
    """The body limit leaves room for base64 images up to hmad's frame limit: a body of about 24 MiB (18 MiB
    of images) is read whole (hmad then answers it), one over the body limit is a 413."""
    big = PNG + b"\0" * (6 << 20)  # a PNG's signature: the gateway checks no more (hmad decodes)
    body = {"model": "any", "prompt": "x", "images": [base64.b64encode(big).decode()] * 3, "stream": False}
    r = http.post("/api/generate", json=body)
    assert r.status_code != 413, r.text
    from hmad_openai.gateway import MAX_BODY_BYTES

    r = http.post(
        "/api/generate", content=b" " * (MAX_BODY_BYTES + 1), headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 413


# -- the translation, in the gateway's own terms -----------------------------------------------------------


def test_translations_keep_text_and_images_in_order():
    chat = ChatRequest.model_validate({"messages": [{"role": "user", "content": _openai_parts()}]})
    assert chat.hmad_messages() == HMAD_MESSAGES
    text_only = ChatRequest.model_validate(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}
    )
    assert text_only.hmad_messages() == [{"role": "user", "content": "a"}]  # no image: a str, as before
    content = [
        {"type": "input_text", "text": "what is"},
        {"type": "input_image", "image_url": DATA_URI},
        {"type": "input_text", "text": "this?"},
    ]
    responses = ResponsesBody.model_validate(
        {"instructions": "brief", "input": [{"role": "user", "content": content}]}
    )
    assert responses.hmad_messages() == [{"role": "system", "content": "brief"}, *HMAD_MESSAGES]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64}}
    blocks = [{"type": "text", "text": "what is"}, image, {"type": "text", "text": "this?"}]
    claude = MessagesBody.model_validate(
        {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": blocks}]}
    )
    assert claude.hmad_messages() == HMAD_MESSAGES
    olla = ChatBody.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi", "images": [B64, B64]}]}
    )
    assert olla.hmad_messages() == [
        {"role": "user", "content": [{"type": "image", "image": PNG}] * 2 + [{"type": "text", "text": "hi"}]}
    ]
    gen = GenerateBody.model_validate({"model": "m", "prompt": "hi", "images": [B64]})
    assert gen.inputs() == {"prompt": "hi", "images": [PNG]}
    gen = GenerateBody.model_validate({"model": "m", "prompt": "hi", "system": "s", "images": [B64]})
    assert gen.inputs()["messages"][1] == {
        "role": "user",
        "content": [{"type": "image", "image": PNG}, {"type": "text", "text": "hi"}],
    }
    wrapped = ChatRequest.model_validate(
        _chat(_openai_parts("data:image/png;base64," + "\n".join([B64[:10], B64[10:]]).rstrip("=")))
    )
    assert wrapped.hmad_messages() == HMAD_MESSAGES  # line breaks and missing padding are tolerated
    with pytest.raises(OpenAIError, match="remote image URLs"):
        ChatRequest.model_validate(_chat(_openai_parts("HTTPS://EXAMPLE.COM/A.PNG"))).hmad_messages()


# -- fuzz --------------------------------------------------------------------------------------------------

_URIS = st.sampled_from(
    [DATA_URI, "https://x/a.png", "data:image/png;base64,@@", "data:,", "", "data:image/gif;base64,R0lGODlh"]
)
_OPENAI_PART = st.fixed_dictionaries(
    {
        "type": st.sampled_from(["image_url", "text", "input_image"]),
        "image_url": st.one_of(_URIS, st.fixed_dictionaries({"url": _URIS})),
    }
)
_ANTHROPIC_BLOCK = st.fixed_dictionaries(
    {
        "type": st.just("image"),
        "source": st.fixed_dictionaries(
            {
                "type": st.sampled_from(["base64", "url", "file"]),
                "media_type": st.sampled_from(["image/png", "text/plain"]),
                "data": st.sampled_from([B64, "@@", "", "aGk="]),
            }
        ),
    }
)
_IMAGES = st.lists(st.sampled_from([B64, "aGk=", "", "@@", 3]), max_size=3)
SHAPES = {
    "messages": st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "assistant", "system"]),
                "content": st.lists(_OPENAI_PART | _ANTHROPIC_BLOCK, max_size=3),
            },
            optional={"images": _IMAGES},
        ),
        max_size=2,
    ),
    "input": st.lists(
        st.fixed_dictionaries({"role": st.just("user"), "content": st.lists(_OPENAI_PART, max_size=2)}),
        max_size=2,
    ),
    "images": _IMAGES,
}


@FUZZ
@given(
    path=st.sampled_from(
        ["/v1/chat/completions", "/v1/responses", "/v1/messages", "/api/chat", "/api/generate"]
    ),
    body=st.data(),
)
def test_fuzz_image_bodies_one_reply_each(gateway, daemon, path, body):
    """Bodies around a valid image request, their image shapes drawn: each gets one answer, 200 or a 4xx in
    the API's shape, and the gateway and hmad serve on."""
    valid = {
        "model": "any",
        "max_tokens": 2,
        "stream": False,
        "prompt": "x",
        "messages": [{"role": "user", "content": _openai_parts()}],
    }
    data = body.draw(malformed(valid, SHAPES))
    headers = {"Authorization": f"Bearer {KEY}", "x-api-key": KEY, "Content-Type": "application/json"}
    r = httpx.post(gateway.url + path, content=data, headers=headers, timeout=60)
    assert r.status_code in (200, 400, 404, 422), r.text
    if r.status_code != 200:
        error = r.json()["error"]
        assert isinstance(error, str) if path.startswith("/api/") else isinstance(error["message"], str), (
            r.text
        )
    else:
        assert json.loads(r.text.splitlines()[-1]), r.text
    assert_serving(daemon, gateway)
