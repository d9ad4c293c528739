"""The daemon's configuration: built-in defaults < one YAML file < command-line overrides, checked on load.

Where the YAML file comes from: ``--config PATH``, else ``$HMAD_CONFIG``, else ``/etc/hmad/hmad.yaml`` when it
exists, else none. Overrides are a dict of dotted keys (``{"engine.max_seqs": 32, "socket.path": ...}``); a
section name with a mapping works too. ``etc/hmad.yaml`` documents every key, and a test keeps it equal to the
built-in defaults.

Each section is a pydantic model (strict types, frozen); a section that configures a class takes its keys
and defaults from it (engine: SchedulerConfig, vulkan: VulkanOptions, cpu: CpuBackend, npu: NpuBackend,
sampling: the one table of the sampling fields, hmaclient.sampling; vision: hmad.model.images.ImageLimits,
under longer names): only the ranges are written here.
Every value is checked; a bad one raises ``ConfigError`` naming the dotted key, what is allowed, what was
given and where it came from (one function words pydantic's errors so: ``_explain``)::

    engine.max_seqs: must be an integer from 1 to 1024, got 'many' (in /etc/hmad/hmad.yaml)
    unknown key 'engine.max_seq' (allowed: max_seqs, step_tokens, ...; did you mean 'max_seqs'?) (in ...)

Unknown keys, duplicate keys, non-mapping documents and YAML syntax errors (with file:line:column) are refused
too: a typo never silently falls back to a default.
"""

from __future__ import annotations

import difflib
import inspect
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
)

from hmaclient import protocol as P
from hmaclient import sampling as sampling_fields
from hmad.backends.cpu import CpuBackend
from hmad.backends.npu.backend import NpuBackend
from hmad.backends.npu.routing import NPU_OPS  # the NPU backend owns its op list
from hmad.backends.vulkan.options import MATVEC_MODES, VulkanOptions
from hmad.config_keys import (  # the keys' types; parse_bytes and UNIX_PATH_MAX are this module's API too
    BOOL,
    TRISTATE,
    UNIX_PATH_MAX,
    absolute_path,
    byte_size,
    custom,
    device,
    int_in,
    mode_bits,
    one_of,
    or_null,
    parse_bytes,  # noqa: F401 - hmad.config.parse_bytes, as before
    power_of_two,
    real_in,
    show,
    socket_path,
    subset,
    text,
    texts,
    typed,
)
from hmad.core.errors import HmadError
from hmad.engine.images import CACHE_BYTES, WAITING_BYTES
from hmad.engine.sampling_schema import sampling_model
from hmad.engine.scheduler import SchedulerConfig
from hmad.engine.speculation.config import MODES as SPECULATION_MODES
from hmad.engine.speculation.config import SpeculationConfig
from hmad.model.images import ImageLimits

if TYPE_CHECKING:
    from hmad.engine.sampling import SamplingParams

SYSTEM_CONFIG = "/etc/hmad/hmad.yaml"


class ConfigError(HmadError):
    """A configuration the daemon refuses; ``key``: the dotted key at fault (None: a file-level problem)."""

    def __init__(self, message: str, key: str | None = None, origin: str | None = None):
        self.key, self.origin = key, origin
        text = f"{key}: {message}" if key else message
        super().__init__(f"{text} ({origin})" if origin else text)


# --- the sections ---------------------------------------------------------------------------------------


class _Section(BaseModel):
    """A config section: frozen, strict, unknown keys refused."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")


def _mirror(
    name: str,
    of: Callable[..., Any],
    types: dict[str, Any],
    every: bool = False,
    skip: tuple[str, ...] = (),
    **own: tuple[Any, Any],
) -> type[_Section]:
    """A section whose keys are parameters of ``of`` (a dataclass's fields, a class's constructor), in its
    order and with its defaults (written there, not here), each typed by ``types`` (every key it names must
    be a parameter of ``of``; with ``every``, every parameter must have a type, but those in ``skip``: set
    from another section); ``own``: (type, default) of the section's own keys."""
    params = {k: p.default for k, p in inspect.signature(of).parameters.items() if k not in skip}
    strays = sorted(set(types) ^ set(params) if every else set(types) - set(params))
    if strays:
        raise TypeError(f"{name} and {of.__name__} disagree on {', '.join(strays)}")
    spec = {k: (types[k], default) for k, default in params.items() if k in types}
    return create_model(name, __base__=_Section, **spec, **own)


_SocketPath = or_null(
    custom(str, f"an absolute path of at most {UNIX_PATH_MAX} bytes", socket_path), "the default"
)
_Mode = custom(int, "permission bits from 0000 to 0777, such as '0660'", mode_bits, lambda v: f"{v:04o}")
_Group = or_null(text("a group name (a string)"), "the daemon's own group")


class SocketConfig(_Section):
    path: _SocketPath = None  # load_config fills the default in
    mode: _Mode = 0o660
    group: _Group = None


#: engine: hmad.engine.scheduler.SchedulerConfig's fields (every one) with their ranges, and ``deterministic``
#: (a backend option: batch-invariant numerics, "auto" = the backend's default, see docs/determinism.md)
EngineConfig = _mirror(
    "EngineConfig",
    SchedulerConfig,
    {
        "max_seqs": int_in(1, 1024),
        "step_tokens": int_in(1, 65536),
        "max_chunk": int_in(1, 65536),
        "kv_tokens": int_in(1, 1 << 24),
        "block_size": typed(
            int, "a power of two from 1 to 256", Field(ge=1, le=256), AfterValidator(power_of_two)
        ),
        "max_queue": int_in(1, 65536),
        "context_length": int_in(0, 1 << 24),
        "prefix_cache": BOOL,
        "pipeline": BOOL,
    },
    every=True,
    skip=("speculation",),  # its own section, below
    deterministic=(TRISTATE, "auto"),
)

#: speculation: hmad.engine.speculation.SpeculationConfig's fields (docs/speculation.md); YAML reads a bare
#: ``off`` as false, taken as "off"
SpeculationSection = _mirror(
    "SpeculationConfig",
    SpeculationConfig,
    {
        "mode": typed(
            Literal[SPECULATION_MODES],
            "one of " + ", ".join(SPECULATION_MODES),
            BeforeValidator(lambda v: "off" if v is False else v.lower() if isinstance(v, str) else v),
        ),
        "draft_model": text("'default', a .gguf file or a pulled model's name"),
        "k_max": int_in(1, 64),
        "ngram_min": int_in(1, 16),
        "ngram_max": int_in(1, 16),
        "max_batch": int_in(1, 1024),
    },
    every=True,
)


class LimitsConfig(_Section):
    max_frame_bytes: byte_size(1 << 10, 1 << 30) = P.MAX_FRAME_BYTES  # (images travel in the frame)
    max_prompt_tokens: int_in(0, 1 << 24) = 0


_IMAGES = ImageLimits()  # the vision keys' defaults are ImageLimits'


class VisionConfig(_Section):
    """The limits on a request's images (hmad.model.images.ImageLimits, ``Config.image_limits``)."""

    max_image_bytes: byte_size(1 << 10, 1 << 30) = _IMAGES.max_bytes
    max_image_pixels: int_in(1, 1 << 30) = _IMAGES.max_pixels
    max_images_per_request: int_in(0, 1024) = _IMAGES.max_images
    image_cache_bytes: byte_size(0, 1 << 40) = CACHE_BYTES  # encoded images kept by digest (engine/images.py)
    max_waiting_image_bytes: byte_size(0, 1 << 40) = WAITING_BYTES  # pixels of queued requests' images


class ServerConfig(_Section):
    """The socket's limits on its peers (docs/protocol.md, "Limits")."""

    max_connections: int_in(1, 1 << 20) = 1024
    max_connections_per_uid: int_in(1, 1 << 20) = 256
    max_in_flight_per_connection: int_in(1, 1 << 20) = 64
    max_in_flight_per_uid: int_in(1, 1 << 20) = 128
    max_reply_bytes: byte_size(1 << 20, 1 << 40) = 256 << 20


class ServiceConfig(_Section):
    drain_grace_s: real_in(0.0) = 10.0
    watchdog: BOOL = True
    heartbeat_ivl_s: real_in(0.0, lo_open=True) = 1.0
    heartbeat_timeout_s: real_in(0.0, lo_open=True) = 5.0
    status_every_s: real_in(0.0) = 5.0


class ModelsConfig(_Section):
    """Switching and unloading the model without a restart (hmad.switching, docs/models.md)."""

    switch: one_of("finish", "cancel") = "finish"  # the running requests when another model loads
    switch_grace_s: real_in(0.0) = 30.0  # finish: how long they may run before the rest are cancelled
    keep_alive_s: or_null(real_in(0.0, lo_open=True), "never: the model stays loaded") = None
    allow_switch: BOOL = True  # a generate naming another model loads it (as Ollama does)


class HttpConfig(_Section):
    """The HTTP gateway (hmad-openai: OpenAI's, Anthropic's and Ollama's APIs) that hmad runs as its child
    once the model is loaded (hmad.gateway_child); its flags of the same names."""

    enabled: BOOL = False
    host: text("an address to listen on (an IP address or a host name)") = "127.0.0.1"
    port: int_in(1, 65535) = 8080
    api_key_file: or_null(
        absolute_path("a file whose first line is the bearer token clients must send"),
        "no key: the API is open to whoever reaches the address",
    ) = None
    allowed_hosts: texts("Host names answered besides the loopback ones ('*' for any)") = ()
    cors_origins: texts("web origins whose pages may call the API ('*' for any)") = ()


#: sampling: the defaults of requests that leave a field out; every field, its range and its built-in default
#: from the one table (hmaclient.sampling), as pydantic types from hmad.engine.sampling_schema
SamplingConfig = sampling_model("SamplingConfig", sampling_fields.DEFAULTS, frozen=True)


#: cpu: options of hmad.backends.cpu.CpuBackend (defaults there), all but deterministic (engine's)
CpuConfig = _mirror(
    "CpuConfig",
    CpuBackend,
    {
        "numerics": one_of("ggml", "f32"),
        "weight_cache_bytes": byte_size(),
        "kv_dtype": one_of("float32", "float16"),
    },
)


#: vulkan: the config keys of hmad.backends.vulkan.options.VulkanOptions (defaults there) with their ranges
VulkanConfig = _mirror(
    "VulkanConfig",
    VulkanOptions,
    {
        "device": custom(
            int | str | None,
            "null (the first GPU), a device index >= 0, or a substring of the device name",
            device,
        ),  # noqa: E501
        "device_local_bytes": or_null(byte_size(), "all the heap's budget"),
        "host_visible_bytes": or_null(byte_size(), "all the heap's budget"),
        "matvec": one_of(*MATVEC_MODES),
        "coopmat": one_of("auto", "off"),
        "coopmat_min_tokens": int_in(2),
        "mmq": one_of("auto", "off"),
        "mmq_min_tokens": int_in(2),
        "fuse": BOOL,
        "prefetch_bytes": or_null(byte_size(), "auto: 8 MiB on a discrete GPU, else 0"),
        "step_timeout_s": real_in(1.0),
    },
)


#: npu: NpuBackend's own options (defaults there; it also takes the cpu section's)
NpuConfig = _mirror(
    "NpuConfig",
    NpuBackend,
    {
        "enabled": TRISTATE,
        "ops": subset(NPU_OPS),
        "xclbin_dir": or_null(text(), "the kernels installed with hmad"),
        "min_rows": int_in(1),
        "timeout_s": real_in(0.0, 60.0, lo_open=True),
        "idle_s": real_in(0.0),
    },
)


_SECTIONS: dict[str, type[BaseModel]] = {
    "socket": SocketConfig,
    "engine": EngineConfig,
    "speculation": SpeculationSection,
    "limits": LimitsConfig,
    "vision": VisionConfig,
    "server": ServerConfig,
    "service": ServiceConfig,
    "http": HttpConfig,
    "models": ModelsConfig,
    "sampling": SamplingConfig,
    "cpu": CpuConfig,
    "vulkan": VulkanConfig,
    "npu": NpuConfig,
}


class Config(_Section):
    """The whole configuration; ``load_config`` builds one, ``Config()`` is the built-in defaults. Two are
    equal when their keys are (``source`` aside)."""

    model: text("'default', a .gguf file or an HF checkpoint directory") = "default"
    mmproj: or_null(text("the path of llama.cpp's projector GGUF"), "none") = None
    chat_template: text("'auto', 'builtin' or the path of a Jinja chat template") = "auto"
    backend: one_of("auto", "cpu", "vulkan", "npu") = "auto"
    log_level: one_of("debug", "info", "warning", "error") = "info"
    socket: SocketConfig = Field(default_factory=SocketConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    speculation: SpeculationSection = Field(default_factory=SpeculationSection)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    vision: VisionConfig = Field(default_factory=VisionConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    service: ServiceConfig = Field(default_factory=ServiceConfig)
    http: HttpConfig = Field(default_factory=HttpConfig)
    models: ModelsConfig = Field(default_factory=ModelsConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    cpu: CpuConfig = Field(default_factory=CpuConfig)
    vulkan: VulkanConfig = Field(default_factory=VulkanConfig)
    npu: NpuConfig = Field(default_factory=NpuConfig)
    source: str | None = None  # the YAML file read, if any

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Config):
            return NotImplemented
        return self.model_dump(exclude={"source"}) == other.model_dump(exclude={"source"})

    def to_dict(self) -> dict[str, Any]:
        """Plain data (YAML/JSON-ready; socket.mode as "0660") that loads back to an equal Config."""
        return self.model_dump(mode="json", exclude={"source"})

    def scheduler_config(self) -> SchedulerConfig:
        spec = SpeculationConfig(**self.speculation.model_dump())
        # (deterministic: the backend's, not its)
        return SchedulerConfig(**self.engine.model_dump(exclude={"deterministic"}), speculation=spec)

    def image_limits(self) -> ImageLimits:
        v = self.vision
        return ImageLimits(v.max_image_bytes, v.max_image_pixels, v.max_images_per_request)

    def sampling_defaults(self) -> SamplingParams:
        """A fresh SamplingParams (the scheduler edits its copy) holding the configured defaults."""
        from hmad.engine.sampling import SamplingParams

        values = self.sampling.model_dump()
        return SamplingParams(**{**values, "stop": list(values["stop"])})

    def backend_options(self, name: str) -> dict[str, Any]:
        """Keyword options of backend ``name`` (cpu, vulkan, npu): its section as a dict, plus
        ``deterministic`` (engine.deterministic)."""
        if name not in ("cpu", "vulkan", "npu"):
            raise ValueError(f"no options section for backend {name!r} (allowed: cpu, vulkan, npu)")
        det = {"deterministic": self.engine.deterministic}
        if name == "npu":  # the CPU backend with NPU offload: both sections
            return {**self.cpu.model_dump(), **self.npu.model_dump(), **det}
        return {**getattr(self, name).model_dump(), **det}


# --- loading --------------------------------------------------------------------------------------------


def default_socket_path(env: Mapping[str, str] = os.environ, euid: int | None = None) -> str:
    """Where the socket goes when the config does not say: the one rule daemon and clients share,
    ``hmaclient.protocol.default_socket_path`` ($HMAD_SOCKET, /run/hmad, $XDG_RUNTIME_DIR/hmad, a private
    directory under the temp directory)."""
    return P.default_socket_path(env, euid)


def find_config_file(path: str | None = None, env: Mapping[str, str] = os.environ) -> str | None:
    """The YAML file to read: ``path``, else ``$HMAD_CONFIG``, else /etc/hmad/hmad.yaml if it exists."""
    if path:
        return str(path)
    if env.get("HMAD_CONFIG"):
        return env["HMAD_CONFIG"]
    return SYSTEM_CONFIG if os.path.exists(SYSTEM_CONFIG) else None


def load_config(
    path: str | None = None, overrides: Mapping[str, Any] | None = None, env: Mapping[str, str] = os.environ
) -> Config:
    """Defaults < the YAML file (see ``find_config_file``) < ``overrides``; raises ConfigError.

    ``overrides`` maps dotted keys to values, applied as given: a None value sets the key to null, so
    leave out flags the user did not pass.
    """
    file = find_config_file(path, env)
    layers = []
    if file is not None:
        layers.append(_parse_layer(read_yaml(file), f"in {file}"))
    if overrides:
        origin = "in the command-line overrides"
        layers.append(_parse_layer(_nest(overrides, origin), origin))
    cfg = _build(layers, file)
    if cfg.socket.path is None:
        socket = cfg.socket.model_copy(update={"path": default_socket_path(env)})
        cfg = cfg.model_copy(update={"socket": socket})
    _check_together(cfg)
    return cfg


def parse_override(text: str) -> tuple[str, Any]:
    """``"engine.max_seqs=32"`` -> ``("engine.max_seqs", 32)``; the value is read as YAML (null, [a, b])."""
    key, eq, value = text.partition("=")
    if not eq or not key.strip():
        raise ConfigError(f"an override must look like key=value (e.g. engine.max_seqs=32), got {text!r}")
    try:
        return key.strip(), yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"cannot read the value {value!r}: {e}", key=key.strip()) from None


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key repeated in one mapping (plain PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, list | dict):
                continue  # unhashable: SafeLoader itself raises a marked error for it
            if key in first_line:
                problem = f"duplicate key {key!r} (first at line {first_line[key]})"
                raise yaml.constructor.ConstructorError(None, None, problem, key_node.start_mark)
            first_line[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def read_yaml(path: str) -> dict[str, Any]:
    """The top-level mapping of a YAML file ({} when empty); ConfigError with file:line on any problem."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file {path}: {getattr(e, 'strerror', None) or e}") from None
    try:
        doc = yaml.load(text, Loader=_StrictLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
        raise ConfigError(f"{where}: invalid YAML: {_yaml_problem(e)}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(
            f"{path}: the document must be a mapping of keys ({', '.join(_names(Config))}), "
            f"got {type(doc).__name__} {show(doc)}"
        )
    return doc


def _yaml_problem(e: yaml.MarkedYAMLError) -> str:
    if not (e.context and e.problem):
        return str(e.problem or e.context)
    if e.context.startswith("while "):
        return f"{e.problem} ({e.context})"
    return f"{e.context}, {e.problem}"  # "expected a single document in the stream, but found another ..."


def _nest(overrides: Mapping[str, Any], origin: str) -> dict[str, Any]:
    """{"engine.max_seqs": 8, "model": m} -> {"engine": {"max_seqs": 8}, "model": m}."""
    nested: dict[str, Any] = {}
    for dotted, value in overrides.items():
        head, dot, rest = str(dotted).partition(".")
        if not dot:
            merge = isinstance(value, Mapping) and isinstance(nested.get(head), dict)
            nested[head] = {**nested[head], **value} if merge else value
        elif head in _SECTIONS:
            sub = nested.setdefault(head, {})
            if not isinstance(sub, dict):
                raise ConfigError("given both as a whole and by key", key=head, origin=origin)
            sub[rest] = value
        else:
            raise _unknown(str(dotted), _names(Config), origin)
    return nested


def _parse_layer(raw: Mapping[str, Any], origin: str) -> dict[str, Any]:
    """Check one source's keys and values: {top-level key: value, section: {key: value}} (partial)."""
    out: dict[str, Any] = {}
    for key in raw:
        if key not in _names(Config):
            raise _unknown(str(key), _names(Config), origin)
    top = {k: v for k, v in raw.items() if k not in _SECTIONS}
    checked = _validated(Config, top, "", origin)
    out.update({k: getattr(checked, k) for k in top})
    for name, value in raw.items():
        if name in _SECTIONS:
            out[name] = _parse_section(_SECTIONS[name], value, name, origin)
    return out


def _parse_section(cls: type[BaseModel], raw: Any, name: str, origin: str) -> dict[str, Any]:
    if raw is None:
        return {}  # "engine:" with every key commented out
    if not isinstance(raw, Mapping):
        keys = ", ".join(cls.model_fields)
        raise ConfigError(f"must be a mapping with keys {keys}, got {show(raw)}", name, origin)
    raw = dict(raw)
    if cls is SamplingConfig and isinstance(raw.get("stop"), str):
        raw["stop"] = [raw["stop"]]  # one stop string may be written as such
    checked = _validated(cls, raw, f"{name}.", origin)
    return {k: getattr(checked, k) for k in raw}


def _validated(cls: type[BaseModel], raw: Mapping[str, Any], prefix: str, origin: str) -> BaseModel:
    """``cls`` from ``raw`` (a partial mapping: the rest at defaults), or the ConfigError of its first
    fault."""
    try:
        return cls.model_validate(raw)
    except ValidationError as e:
        raise _explain(cls, e.errors(include_url=False)[0], raw, prefix, origin) from None


def _explain(cls: type[BaseModel], err: Any, raw: Mapping[str, Any], prefix: str, origin: str) -> ConfigError:
    """One pydantic error (its loc, type and ctx) as the config's message, the one shape every bad key
    gets: "<key>: must be <what it allows>, got <the value><hint>", or the unknown key and the allowed."""
    key = err["loc"][0]
    if err["type"] == "extra_forbidden" or key not in cls.model_fields:
        allowed = [k for k in cls.model_fields if k != "source"]
        return _unknown(f"{prefix}{key}", allowed, origin)
    says = cls.model_fields[key].description or err["msg"]
    hint = err.get("ctx", {}).get("hint", "") if err["type"] == "hmad" else ""
    return ConfigError(f"must be {says}, got {show(raw[key])}{hint}", f"{prefix}{key}", origin)


def _build(layers: list[dict[str, Any]], source: str | None) -> Config:
    """Defaults with each layer's keys laid over them, in order (every value is checked already)."""
    kwargs: dict[str, Any] = {}
    for layer in layers:
        kwargs.update({k: v for k, v in layer.items() if k not in _SECTIONS})
    for name, cls in _SECTIONS.items():
        values: dict[str, Any] = {}
        for layer in layers:
            values.update(layer.get(name, {}))
        kwargs[name] = cls(**values)
    return Config(**kwargs, source=source)


def _check_together(cfg: Config) -> None:
    """Rules between keys, once every source has been applied."""
    svc = cfg.service
    if svc.heartbeat_timeout_s <= svc.heartbeat_ivl_s:
        raise ConfigError(
            f"must be greater than service.heartbeat_ivl_s ({svc.heartbeat_ivl_s:g}), "
            f"got {svc.heartbeat_timeout_s:g}",
            "service.heartbeat_timeout_s",
        )
    spec = cfg.speculation
    if spec.ngram_max < spec.ngram_min:
        raise ConfigError(
            f"must be at least speculation.ngram_min ({spec.ngram_min}), got {spec.ngram_max}",
            "speculation.ngram_max",
        )
    if cfg.backend == "npu" and cfg.npu.enabled is False:
        raise ConfigError(
            "is false, but backend is npu (set npu.enabled: auto or true, or another backend)", "npu.enabled"
        )


def _unknown(dotted: str, allowed: list[str], origin: str) -> ConfigError:
    leaf = dotted.rpartition(".")[2]
    close = difflib.get_close_matches(leaf, allowed, n=1)
    guess = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"unknown key {dotted!r} (allowed: {', '.join(allowed)}{guess})", origin=origin)


def _names(cls: type[BaseModel]) -> list[str]:
    return [k for k in cls.model_fields if k != "source"]
