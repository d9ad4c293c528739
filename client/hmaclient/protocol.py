"""The hmad wire protocol, version 5: every message, every field, every limit. This module is the spec.

Transport
=========
ZeroMQ over a Unix socket (``ipc://PATH``). The daemon binds a ROUTER, each client connects one DEALER.
A message is **one frame** holding **one msgpack map** (the ROUTER adds and strips the peer's identity
frame; neither side ever sees or sends more frames). Strings are msgpack ``str`` (UTF-8); ``bin`` appears
only as an image's bytes (``generate.images`` and image parts: a bin anywhere else is refused, naming where);
no ``ext`` types (timestamps included) appear anywhere. Every message has

    v     int   protocol version: the rules this message follows, one of SUPPORTED_VERSIONS (1, 2, 3, 4, 5)
    type  str   the message type, below

Requests are **strict**: a field not listed for its type is refused, naming the field. Replies are
**lenient**: clients ignore fields they do not know, so the daemon may add fields without a new version.

Versions
--------
Version 2 adds ``generate.json_schema`` (structured output); version 3 tool calling (``tools``,
``tool_choice``, ``parallel_tool_calls``), ``logprobs``, ``prompt_logprobs`` and OpenAI's additive
adjustments (``presence_penalty``, ``frequency_penalty``, ``logit_bias``); version 4 images
(``generate.images``, and a message ``content`` that is a list of parts, named CONTENT_PARTS); version 5
models (``generate.model``, the requests MODEL_REQUESTS and their reply ``result``) and
``generate.speculate``. ``ADDED_IN``
lists every request type and field newer than version 1 with the version that brought it. The daemon
serves messages of every supported version: a message of version v may use only what version v had (an
older ``v`` using a newer field or type is refused with ``bad_request`` naming the field and the version
it needs), and every reply to it carries the same ``v`` (a reply to a frame whose ``v`` could not be
read or is not supported carries 1, which every client reads). So a version-1 client keeps working
unchanged. Clients stamp the lowest version their message needs (``required_version``; hmaclient does),
so a newer client also keeps working with an older daemon for everything the older one knows.

Ids
---
A client names each request with ``id`` (str of 1..128 characters, or an int in [-2^63, 2^64)); every reply
to it carries the same ``id``. Ids are scoped to one connection: the daemon keys requests by
(peer identity, id), so two clients may use the same ids. A client must not reuse the id of a request still
in flight on its connection (a ``generate`` doing so is refused with ``bad_request``; the first goes on).
Requests without an ``id`` get replies with ``id: nil``; such a generation cannot be cancelled by id.

Requests (client -> daemon)
===========================
``generate``  start a generation
    id                  str | int           optional (see Ids)
    prompt              str                 exactly one of prompt / messages; <= MAX_PROMPT_CHARS characters
    messages            list of maps        1..MAX_MESSAGES of {role: "system"|"user"|"model"|"assistant",
                                            content: str | list of parts}; exactly these two keys, but for
                                            tool turns (whose content is a str):
                                            an assistant's ``tool_calls`` (1..64 {id, name, arguments: a
                                            JSON object or its text}; content may then be "" or nil) and
                                            {role: "tool", content, tool_call_id, name?} (a call's result);
                                            "assistant" = "model"; at most one "system", and only first
                                            (Gemma's template); total content <= MAX_PROMPT_CHARS characters
                                            (of a list: its text parts'). Since version 4 a content may be
                                            a list of 1..MAX_PARTS (64) parts, in order:
                                              {type: "text", text: str}
                                              {type: "image", image: bin}  an encoded image file (PNG,
                                                JPEG, WebP, GIF or BMP, told by its first bytes:
                                                IMAGE_SIGNATURES); only in a "user" message
                                            A list stays a list (a text-only one too); the daemon turns
                                            each image into the model's image tokens.
    images              list of bin         since version 4. 1..MAX_IMAGES (16) encoded image files, as an
                                            image part's; only with ``prompt`` and raw=false: they go into
                                            the one user turn before the prompt's text (as Ollama's
                                            generate does). With raw=true: bad_request ("images need the
                                            chat template"). A request's images, ``images`` and every
                                            message's together, are <= MAX_IMAGES; the daemon's config may
                                            take fewer (too_large), and a model without a vision tower
                                            answers ``unsupported``.
    raw                 bool                default false. With ``prompt``: false wraps the prompt in the chat
                                            template as one user turn (plus the generation prompt); true sends
                                            the text to the tokenizer as is. Must be false with ``messages``.
    the sampling fields (types, ranges and defaults: hmaclient.sampling.FIELDS, listed here from it;
    "default" is the daemon's built-in one, which its config's ``sampling:`` section may change):
{SAMPLING_TABLE}
    stream              bool                default true: ``token`` messages as text is produced.
                                            false: no ``token`` messages; ``done`` carries text and token_ids
    json_schema         map                 since version 2. A JSON Schema the answer must satisfy: sampling
                                            is constrained so the text is one JSON value that parses and
                                            validates (``{"type": "object"}``: any JSON object). A schema the
                                            daemon cannot compile is refused (bad_request naming the
                                            problem), as is any json_schema when the daemon lacks its
                                            grammar library. See ``done.schema_complete``.
    tools               list of maps        <= 128 {name (1..64 of A-Za-z0-9_.-, unique), description?: str,
                                            parameters?: a JSON Schema map}; OpenAI's {type: "function",
                                            function: {...}} taken too. Functions the answer may call.
    tool_choice         str | map           "auto" (default) | "none" | "required" | {name} (one of tools):
                                            the answer may / must not / must be calls, or must call that one.
                                            Calls are decoded under a grammar of the tools' schemas, so their
                                            arguments always validate; with "auto" an answer whose first
                                            non-space character is { or [ is a call, any other is text.
                                            Not with json_schema (unless "none"); not with a raw prompt.
    parallel_tool_calls bool                default true: an answer may be a JSON list of calls (1..16).
                                            (docs/protocol.md: the prompt form, the grammar, the triggers.)
    logprobs            int | nil           0..MAX_LOGPROBS (20), default nil (none): each generated token
                                            reports its logprob and this many most likely alternatives
                                            (``token.logprobs``, ``done.logprobs``). The model's
                                            distribution before temperature, over the whole vocabulary.
    prompt_logprobs     int | nil           0..MAX_LOGPROBS, default nil: likewise for each prompt token
                                            (``done.prompt_logprobs``); the prompt is then computed whole
                                            (no prefix cache). Both: COUNT_FIELDS; docs/protocol.md.
    model               str                 since version 5. 1..MAX_MODEL_CHARS characters: the model to
                                            answer with (a pulled model's name, hf:REPO[:QUANT] once
                                            pulled, "default", or a file the daemon may read). Another model
                                            than the loaded one is loaded first if the daemon's config
                                            allows (models.allow_switch; else switch_refused); absent: the
                                            loaded one.
    speculate           bool                since version 5. default true: the daemon may decode this
                                            request speculatively when its config turns speculation on
                                            (speculation.mode); false: never. The answer is the same
                                            either way (docs/speculation.md).
    An absent sampling field (or nil) means "the daemon's default" (its config's ``sampling:`` section).
    An int field takes ints only, a number field ints or finite floats; bools are not numbers.

``cancel``    stop a generation of this connection
    id                  str | int           required: the id the ``generate`` carried
    The answer is that generation's terminal reply: ``cancelled`` (or ``done``/``error`` if it ended first).
    Only when no generation with that id is in flight on this connection does the daemon answer
    ``error`` {id, code: not_found}; a client drops replies for ids it no longer tracks, since a cancel
    racing a finished request gets exactly that.

``status``    what the daemon is doing              id optional, echoed
``ping``      liveness                              id optional, echoed
``metrics``   cumulative counters and histograms    id optional, echoed. Since version 2.

Since version 5, the model requests (MODEL_REQUESTS), each answered by one ``result`` (or ``error``):
``models``    the models on the daemon's disk       result: models (list of maps: name, path, mmproj,
                                                    architecture, quantization, size_bytes, context_length,
                                                    chat_template, vision, loaded, problem), loaded, state
``load``      model: str (as generate.model, or     result: switch_id, state, unchanged; the switch then
              hf:REPO[:QUANT], pulled first)        shows in status's ``switch`` map (docs/models.md)
``unload``    free the model; the next generate     result: switch_id, state, unchanged
              loads it back
``remove``    model: str, a pulled model's name     result: name, path, freed_bytes (model_in_use for the
                                                    loaded one, model_not_found for none)
``pull``      model: str, [hf:]REPO[:QUANT]         result: pull_id, joined, state, phase; status's ``pulls``
                                                    map then shows it by pull_id (docs/protocol.md)

Replies (daemon -> client)
==========================
``accepted``   {id, rid}: the generation is queued; rid (int) is the daemon's own request number (logs).
``token``      {id, text, token_ids}: the next piece of the answer. text (str) may be "" (a token that
               completes no character yet); token_ids (list of int) are the ids this piece covers
               (the ids of a stop string's tokens are included though its text is never sent).
               Concatenating every piece's text and token_ids gives what ``done`` would carry with
               stream=false.
               With ``logprobs``: also logprobs, one entry per id of token_ids, in order:
               {token_id: int, text: str (the token's own bytes as UTF-8; one byte of a multi-byte
               character reads U+FFFD), logprob: float <= 0, top: list of [id, logprob, text], most likely
               first, at most ``logprobs`` long}. Clients read it as ``Logprob``.
``done``       {id, finish_reason, prompt_tokens, generated_tokens, ttft_s, tokens_per_s, total_s,
               cached_tokens, and with stream=false: text, token_ids}
               finish_reason: "stop" (end of turn / EOS, or a stop string, or with json_schema: the JSON
               value is complete) | "length" (max_tokens, or the context is full) | "tool_calls" (the
               answer is complete tool calls: then also tool_calls, a list of {id, name, arguments: the
               parameters object's JSON text}; absent otherwise, so clients read it as optional).
               prompt_tokens, generated_tokens: int. ttft_s (arrival -> first token), total_s (arrival ->
               end): float seconds; tokens_per_s: float decode rate (0 if < 2 tokens).
               cached_tokens: int, the prompt tokens whose KV came from the prefix cache (not computed;
               absent from daemons before it, so clients read it as optional: Done.extra).
               stop_sequence: str, the stop string that ended the answer (only then; Done.extra).
               With ``logprobs`` and stream=false also logprobs (entries as on ``token``, one per id of
               token_ids). With ``prompt_logprobs`` (streamed or not) also prompt_logprobs: one item per
               prompt token as the model saw it (template and BOS included), the first nil, each other an
               entry as above.
               With json_schema also schema_complete (bool): true when the text is a whole JSON value
               that satisfies the schema; false when max_tokens (or the context) ran out first
               (finish_reason "length": the text is a valid but unfinished prefix) or a stop string cut it.
``error``      {id, code, message}: code is one of ERROR_CODES (stable strings), message is for people.
``cancelled``  {id, generated_tokens}
``status``     {id, status: map}: what the daemon reports, free-form but nested at most MAX_DEPTH - 2 deep,
               with keys such as model, backend, device, deterministic (bool: batch-invariant numerics,
               engine.deterministic), memory (per heap), context, running, queued,
               batch_sizes, tokens_per_s, kv_cache, uptime_s. Keys ending in ``_bytes`` are byte counts and
               ``_s`` seconds (``hmactl status`` formats them so).
``pong``       {id, time, state}: the daemon's wall clock, float seconds since the epoch; state "ready"
               (generations are served) or "loading" (the socket answers while the model loads: status
               shows the progress, a ``generate`` gets ``error`` code ``loading``; after the start, while
               another model is switched in, a generate waits for it) or "no_model" (its load failed and
               none is loaded: ``load`` one). A reply without state
               comes from a daemon that answers only once ready.
``result``     {id, result: map} (since version 5): the answer to a model request, its keys above.
``metrics``    {id, metrics: list of families} (since version 2): what Prometheus calls metric families,
               counted since the daemon started. A family is
                   {name: str, type: "counter" | "gauge" | "histogram", help: str, samples: list}
               name is snake_case, without a prefix or a ``_total`` suffix, its unit last (``_seconds``,
               ``_bytes``). A sample of a counter or gauge is {labels: map of str -> str, value: number};
               one of a histogram is {labels, bounds: list of number (ascending upper bounds),
               buckets: list of int (buckets[i] = observations <= bounds[i], cumulative), count: int (all
               observations), sum: number}. Which families exist is the daemon's to say (docs/protocol.md
               lists them); clients show what comes.

Order: a ``generate`` gets either one ``error`` (refused: nothing else follows), or ``accepted`` then any
number of ``token`` then **exactly one** terminal reply: ``done`` | ``error`` | ``cancelled``. An ``error``
may follow ``accepted`` (e.g. prompt_too_long is known only once the prompt is tokenized).
``status``, ``ping`` and ``metrics`` get one reply each. A frame the daemon cannot parse gets ``error``
with the request's id when it could be read, else ``id: nil``.

Error codes
===========
    bad_request           malformed msgpack, not a map, wrong type or range of a field, unknown or missing
                          field, duplicate id in flight, text the model's vocabulary cannot encode (a GGUF
                          without byte-fallback tokens; the message names the character)
    unsupported_version   ``v`` is an int not in SUPPORTED_VERSIONS
    unknown_type          ``type`` names no request
    too_large             frame over MAX_FRAME_BYTES, or an array / map / nesting depth / container count /
                          request item count / prompt / message count / image count over its limit
    busy                  the daemon's queue is full; try again later
    prompt_too_long       the tokenized prompt (+1) does not fit the model's context
    shutting_down         the daemon is draining for shutdown and takes no new work
    not_found             ``cancel`` of an id not in flight on this connection
    unsupported           the loaded model cannot do what the request asks (e.g. images on a model
                          without a vision tower); the message says what
    internal              a bug or device failure in the daemon; the message says what. Only the requests
                          it concerns get it (one failed step: that step's); the daemon serves on unless
                          its device is lost, when it answers everyone and exits 1
    model_not_found       (v5) the model a request names is not on the daemon's machine, or failed to load
    switch_refused        (v5) generate.model names another model and the config forbids switching
    model_in_use          (v5) remove of the loaded model
    no_model              no model is loaded (its load failed): any version's generate may get it

Limits (enforced in ``unpack`` before any field is looked at)
=============================================================
    frame            <= MAX_FRAME_BYTES (32 MiB, room for images; the daemon sets ZMQ_MAXMSGSIZE to it;
                     replies <= MAX_REPLY_BYTES)
    arrays           <= MAX_ARRAY_LEN items; maps <= MAX_MAP_LEN entries (else too_large); a request's
                     arrays and maps hold <= MAX_REQUEST_ITEMS items and entries in all (its unpack stops
                     past them: the work of a frame is bounded by its items, not its bytes)
    declared sizes   a str/bin/array/map header declaring more than the rest of the frame can hold is
                     refused at once as bad_request (truncated), allocating nothing: limits passed to
                     msgpack are min(protocol limit, what len(frame) could hold)
    nesting          <= MAX_DEPTH containers deep (the top-level map is depth 1; 8 before version 2)
    containers       <= MAX_CONTAINERS arrays and maps in all (too_large)
    map keys         str only
    exactly one msgpack object per frame: trailing bytes are refused

Socket path
===========
``default_socket_path()`` is the one rule, for the daemon and its clients alike: ``$HMAD_SOCKET``; else
``/run/hmad/hmad.sock`` for root or when /run/hmad is a directory this user may enter (the systemd service's
RuntimeDirectory); else ``$XDG_RUNTIME_DIR/hmad/hmad.sock``; else ``$TMPDIR`` (or /tmp)
``/hmad-<uid>/hmad.sock``. ``endpoint(path)`` gives the ZeroMQ address. Before connecting, clients check who
owns the socket and the directories above it (``hmaclient.safepath``).
"""

from __future__ import annotations

# This module is the spec and the one import point; the code lives by what it owns:
# hmaclient.framing (envelope, limits, frames), .request (requests), .reply (replies), .paths (the
# socket path) and .sampling (the sampling fields).
from hmaclient import sampling
from hmaclient.framing import (  # noqa: F401
    ADDED_IN,
    BAD_REQUEST,
    BUSY,
    CONTENT_PARTS,
    ERROR_CODES,
    FINISH_REASONS,
    IMAGE_SIGNATURES,
    INTERNAL,
    LOADING,
    MAX_ARRAY_LEN,
    MAX_CONTAINERS,
    MAX_DEPTH,
    MAX_FRAME_BYTES,
    MAX_ID_CHARS,
    MAX_IMAGES,
    MAX_MAP_LEN,
    MAX_MESSAGES,
    MAX_PARTS,
    MAX_PROMPT_CHARS,
    MAX_REPETITION_PENALTY,
    MAX_REPLY_BYTES,
    MAX_REQUEST_ITEMS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    MAX_TOKENS_LIMIT,
    METRIC_TYPES,
    MODEL_IN_USE,
    MODEL_NOT_FOUND,
    MODEL_REQUESTS,
    NO_MODEL,
    NOT_FOUND,
    PROMPT_TOO_LONG,
    PROTOCOL_VERSION,
    REPLY_TYPES,
    REQUEST_TYPES,
    ROLES,
    SHUTTING_DOWN,
    SUPPORTED_VERSIONS,
    SWITCH_REFUSED,
    TERMINAL_TYPES,
    TOO_LARGE,
    UNKNOWN_TYPE,
    UNSUPPORTED,
    UNSUPPORTED_VERSION,
    Id,
    ProtocolError,
    image_format,
    pack,
    required_version,
    unpack,
)
from hmaclient.paths import (  # noqa: F401
    MAX_IPC_PATH_BYTES,
    SYSTEM_SOCKET_DIR,
    default_socket_path,
    endpoint,
)
from hmaclient.reply import (  # noqa: F401
    Accepted,
    Cancelled,
    Done,
    Error,
    Logprob,
    Metrics,
    Pong,
    Reply,
    Result,
    Status,
    Token,
    accepted,
    cancelled,
    done,
    error,
    metrics,
    parse_reply,
    pong,
    result,
    status,
    token,
)
from hmaclient.request import (  # noqa: F401
    COUNT_FIELDS,
    MAX_MODEL_CHARS,
    SAMPLING_FIELDS,
    CancelRequest,
    GenerateRequest,
    MetricsRequest,
    ModelRequest,
    PingRequest,
    Request,
    StatusRequest,
    cancel_request,
    generate_request,
    metrics_request,
    model_request,
    parse_request,
    ping_request,
    status_request,
    validate_request,
)
from hmaclient.sampling import MAX_LOGPROBS  # noqa: F401

__doc__ = (__doc__ or "").replace("{SAMPLING_TABLE}", sampling.table())
