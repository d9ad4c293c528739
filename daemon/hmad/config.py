"""The daemon's configuration: built-in defaults < one YAML file < command-line overrides, checked on load.

Where the YAML file comes from: ``--config PATH``, else ``$HMAD_CONFIG``, else ``/etc/hmad/hmad.yaml`` when it
exists, else none. Overrides are a dict of dotted keys (``{"engine.max_seqs": 32, "socket.path": ...}``); a
section name with a mapping works too. ``etc/hmad.yaml`` documents every key, and a test keeps it equal to the
defaults written here.

Every value is checked; a bad one raises ``ConfigError`` naming the dotted key, what is allowed, what was
given and where it came from::

    engine.max_seqs: must be an integer from 1 to 1024, got 'many' (in /etc/hmad/hmad.yaml)
    unknown key 'engine.max_seq' (allowed: max_seqs, step_tokens, ...; did you mean 'max_seqs'?) (in ...)

Unknown keys, duplicate keys, non-mapping documents and YAML syntax errors (with file:line:column) are refused
too: a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import yaml

from hmaclient import protocol as P
from hmad.backends.npu.routing import NPU_OPS  # the NPU backend owns its op list
from hmad.core.errors import HmadError

if TYPE_CHECKING:
    from hmad.engine.sampling import SamplingParams
    from hmad.engine.scheduler import SchedulerConfig

SYSTEM_CONFIG = "/etc/hmad/hmad.yaml"
UNIX_PATH_MAX = 107  # sun_path is 108 bytes with the terminating NUL


class ConfigError(HmadError):
    """A configuration the daemon refuses; ``key``: the dotted key at fault (None: a file-level problem)."""

    def __init__(self, message: str, key: str | None = None, origin: str | None = None):
        self.key, self.origin = key, origin
        text = f"{key}: {message}" if key else message
        super().__init__(f"{text} ({origin})" if origin else text)


# --- value checks ---------------------------------------------------------------------------------------
# Each check turns a raw YAML/override value into the stored value or raises _Bad; the loader adds the key,
# the allowed values (``describe``) and the value given. ``show`` turns a stored value back into plain data.


class _Bad(Exception):
    """A value a check refused; ``hint`` is appended to the message."""

    def __init__(self, hint: str = ""):
        super().__init__(hint)
        self.hint = hint


class _Check:
    def describe(self) -> str:
        raise NotImplementedError

    def parse(self, v: Any) -> Any:
        raise NotImplementedError

    def show(self, v: Any) -> Any:
        return v


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # YAML true is a bool, and bool is an int


@dataclass(frozen=True)
class _Int(_Check):
    lo: int
    hi: int | None = None

    def describe(self) -> str:
        if self.hi is None:
            return f"an integer >= {self.lo}"
        return f"an integer from {self.lo} to {self.hi}"

    def parse(self, v: Any) -> int:
        if not _is_int(v) or v < self.lo or (self.hi is not None and v > self.hi):
            raise _Bad()
        return v


@dataclass(frozen=True)
class _PowerOfTwo(_Check):
    lo: int
    hi: int

    def describe(self) -> str:
        return f"a power of two from {self.lo} to {self.hi}"

    def parse(self, v: Any) -> int:
        if not _is_int(v) or not self.lo <= v <= self.hi or v & (v - 1):
            raise _Bad()
        return v


@dataclass(frozen=True)
class _Real(_Check):
    """A finite number (int or float, stored as float) within optional bounds; ``lo_open``: lo excluded."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False

    def describe(self) -> str:
        if self.lo is not None and self.hi is not None:
            return f"a number in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}]"
        if self.lo is not None:
            return f"a number {'>' if self.lo_open else '>='} {self.lo:g}"
        return "a number"

    def parse(self, v: Any) -> float:
        if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
            raise _Bad()
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            raise _Bad()
        if self.hi is not None and v > self.hi:
            raise _Bad()
        return float(v)


@dataclass(frozen=True)
class _Bool(_Check):
    def describe(self) -> str:
        return "true or false"

    def parse(self, v: Any) -> bool:
        if not isinstance(v, bool):
            raise _Bad()
        return v


@dataclass(frozen=True)
class _OneOf(_Check):
    """One of a few words; case-insensitive, stored in lower case."""

    values: tuple[str, ...]

    def describe(self) -> str:
        return "one of " + ", ".join(self.values)

    def parse(self, v: Any) -> str:
        if not isinstance(v, str) or v.lower() not in self.values:
            raise _Bad()
        return v.lower()


@dataclass(frozen=True)
class _Tristate(_Check):
    """auto, true or false (YAML booleans or the words); stored as "auto", True or False."""

    def describe(self) -> str:
        return "one of auto, true, false"

    def parse(self, v: Any) -> str | bool:
        if isinstance(v, bool):
            return v
        words = {"auto": "auto", "true": True, "false": False}
        if not isinstance(v, str) or v.lower() not in words:
            raise _Bad()
        return words[v.lower()]


@dataclass(frozen=True)
class _Text(_Check):
    what: str = "a non-empty string"

    def describe(self) -> str:
        return self.what

    def parse(self, v: Any) -> str:
        if not isinstance(v, str) or not v.strip():
            raise _Bad(" (quote it if YAML read it as a number or boolean)" if _is_scalar(v) else "")
        return v


@dataclass(frozen=True)
class _SocketPath(_Check):
    def describe(self) -> str:
        return f"an absolute path of at most {UNIX_PATH_MAX} bytes, or null for the default"

    def parse(self, v: Any) -> str:
        if not isinstance(v, str) or not os.path.isabs(v):
            raise _Bad()
        if len(os.fsencode(v)) > UNIX_PATH_MAX:
            raise _Bad(f" ({len(os.fsencode(v))} bytes: longer than a Unix socket path can be)")
        return v


_MODE_RE = re.compile(r"(0o|0)?([0-7]{3})")


@dataclass(frozen=True)
class _Mode(_Check):
    """Permission bits of the socket, 0o000..0o777: an int (YAML reads unquoted 0660 as octal) or "0660"."""

    def describe(self) -> str:
        return "permission bits from 0000 to 0777, such as '0660'"

    def parse(self, v: Any) -> int:
        if _is_int(v):
            if 0 <= v <= 0o777:
                return v
            digits = str(v)
            hint = f" (= {v:#o}; did you mean '0{digits}'?)" if _MODE_RE.fullmatch(digits) else ""
            raise _Bad(hint)
        m = _MODE_RE.fullmatch(v) if isinstance(v, str) else None
        if m is None:
            raise _Bad()
        return int(m.group(2), 8)

    def show(self, v: int) -> str:
        return f"{v:04o}"


_BYTE_UNITS = {
    "": 1, "b": 1,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}  # fmt: skip
_BYTES_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")


def parse_bytes(v: Any) -> int:
    """A byte size: an int, or a string such as "8GiB", "512 MiB", "1.5GiB", "4MB" (units: B, KiB, MiB,
    GiB, TiB binary; kB, MB, GB, TB decimal; case-insensitive). Raises ValueError for anything else."""
    if _is_int(v) and v >= 0:
        return v
    m = _BYTES_RE.fullmatch(v) if isinstance(v, str) else None
    if m is None or m.group(2).lower() not in _BYTE_UNITS:
        raise ValueError(f"not a byte size: {v!r}")
    n = Decimal(m.group(1)) * _BYTE_UNITS[m.group(2).lower()]
    if n != n.to_integral_value():
        raise ValueError(f"not a whole number of bytes: {v!r}")
    return int(n)


def _iec(n: int) -> str:
    """1073741824 -> '1GiB' (the largest binary unit that divides n)."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if n and n % _BYTE_UNITS[unit.lower()] == 0:
            return f"{n // _BYTE_UNITS[unit.lower()]}{unit}"
    return str(n)


@dataclass(frozen=True)
class _Bytes(_Check):
    lo: int = 0
    hi: int | None = None

    def describe(self) -> str:
        span = f" from {_iec(self.lo)} to {_iec(self.hi)}" if self.hi is not None else ""
        return (
            f"a byte size{span}: an integer, or a string like '512MiB' or '8GiB' "
            "(units B, KiB, MiB, GiB, TiB, kB, MB, GB, TB)"
        )

    def parse(self, v: Any) -> int:
        try:
            n = parse_bytes(v)
        except ValueError:
            raise _Bad() from None
        if n < self.lo or (self.hi is not None and n > self.hi):
            raise _Bad(f" (= {n} bytes)")
        return n


@dataclass(frozen=True)
class _OrNull(_Check):
    inner: _Check
    null_means: str

    def describe(self) -> str:
        return f"{self.inner.describe()}, or null ({self.null_means})"

    def parse(self, v: Any) -> Any:
        return None if v is None else self.inner.parse(v)

    def show(self, v: Any) -> Any:
        return None if v is None else self.inner.show(v)


@dataclass(frozen=True)
class _Device(_Check):
    def describe(self) -> str:
        return "null (the first GPU), a device index >= 0, or a substring of the device name"

    def parse(self, v: Any) -> int | str | None:
        if v is None or (_is_int(v) and v >= 0) or (isinstance(v, str) and v.strip()):
            return v
        raise _Bad()


@dataclass(frozen=True)
class _Subset(_Check):
    """A list of distinct words from ``known``; stored as a tuple."""

    known: tuple[str, ...]

    def describe(self) -> str:
        return "a list of distinct names from " + ", ".join(self.known)

    def parse(self, v: Any) -> tuple[str, ...]:
        if not isinstance(v, list):
            raise _Bad()
        bad = [x for x in v if x not in self.known]
        if bad:
            raise _Bad(f" (unknown: {', '.join(map(_show, bad))})")
        if len(set(v)) != len(v):
            raise _Bad(" (a name is repeated)")
        return tuple(v)

    def show(self, v: tuple[str, ...]) -> list[str]:
        return list(v)


@dataclass(frozen=True)
class _Strings(_Check):
    """A list of non-empty strings (or one string); stored as a tuple."""

    def describe(self) -> str:
        return "a list of non-empty strings"

    def parse(self, v: Any) -> tuple[str, ...]:
        v = [v] if isinstance(v, str) else v
        if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
            raise _Bad()
        return tuple(v)

    def show(self, v: tuple[str, ...]) -> list[str]:
        return list(v)


def _is_scalar(v: Any) -> bool:
    return isinstance(v, int | float | bool)


def _key(default: Any, check: _Check) -> Any:
    """A config key: its default and the check its values must pass."""
    return field(default=default, metadata={"check": check})


def _section(cls: type) -> Any:
    return field(default_factory=cls, metadata={"section": cls})


# --- the sections ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SocketConfig:
    path: str | None = _key(None, _OrNull(_SocketPath(), "the default"))  # load_config fills the default in
    mode: int = _key(0o660, _Mode())
    group: str | None = _key(None, _OrNull(_Text("a group name (a string)"), "the daemon's own group"))


@dataclass(frozen=True)
class EngineConfig:
    """Mirrors hmad.engine.scheduler.SchedulerConfig field for field, plus ``deterministic`` (a backend
    option: batch-invariant numerics, "auto" = the backend's default, see docs/determinism.md)."""

    max_seqs: int = _key(16, _Int(1, 1024))
    step_tokens: int = _key(512, _Int(1, 65536))
    max_chunk: int = _key(512, _Int(1, 65536))
    kv_tokens: int = _key(32768, _Int(1, 1 << 24))
    block_size: int = _key(16, _PowerOfTwo(1, 256))
    max_queue: int = _key(256, _Int(1, 65536))
    context_length: int = _key(0, _Int(0, 1 << 24))
    prefix_cache: bool = _key(True, _Bool())
    pipeline: bool = _key(True, _Bool())
    deterministic: str | bool = _key("auto", _Tristate())


@dataclass(frozen=True)
class LimitsConfig:
    max_frame_bytes: int = _key(4 << 20, _Bytes(1 << 10, 1 << 30))
    max_prompt_tokens: int = _key(0, _Int(0, 1 << 24))


@dataclass(frozen=True)
class ServerConfig:
    """The socket's limits on its peers (docs/protocol.md, "Limits")."""

    max_connections: int = _key(1024, _Int(1, 1 << 20))
    max_connections_per_uid: int = _key(256, _Int(1, 1 << 20))
    max_in_flight_per_connection: int = _key(64, _Int(1, 1 << 20))
    max_in_flight_per_uid: int = _key(128, _Int(1, 1 << 20))
    max_reply_bytes: int = _key(256 << 20, _Bytes(1 << 20, 1 << 40))


@dataclass(frozen=True)
class ServiceConfig:
    drain_grace_s: float = _key(10.0, _Real(0.0))
    watchdog: bool = _key(True, _Bool())
    heartbeat_ivl_s: float = _key(1.0, _Real(0.0, lo_open=True))
    heartbeat_timeout_s: float = _key(5.0, _Real(0.0, lo_open=True))
    status_every_s: float = _key(5.0, _Real(0.0))


@dataclass(frozen=True)
class SamplingConfig:
    """Defaults for requests that leave a knob out; mirrors hmad.engine.sampling.SamplingParams.

    Gemma 3's recommended settings: temperature 1.0, top_k 64, top_p 0.95, min_p 0.
    """

    temperature: float = _key(1.0, _Real(0.0))
    top_k: int = _key(64, _Int(0))
    top_p: float = _key(0.95, _Real(0.0, 1.0, lo_open=True))
    min_p: float = _key(0.0, _Real(0.0, 1.0))
    repetition_penalty: float = _key(1.0, _Real(0.0, lo_open=True))
    repeat_last_n: int = _key(64, _Int(0))
    seed: int | None = _key(None, _OrNull(_Int(0), "fresh entropy per request"))
    max_tokens: int = _key(512, _Int(1))
    stop: tuple[str, ...] = _key((), _Strings())


@dataclass(frozen=True)
class CpuConfig:
    """Options of hmad.backends.cpu.CpuBackend, same names."""

    numerics: str = _key("ggml", _OneOf(("ggml", "f32")))
    weight_cache_bytes: int = _key(16 << 30, _Bytes())
    kv_dtype: str = _key("float32", _OneOf(("float32", "float16")))


@dataclass(frozen=True)
class VulkanConfig:
    device: int | str | None = _key(None, _Device())
    device_local_bytes: int | None = _key(None, _OrNull(_Bytes(), "all the heap's budget"))
    host_visible_bytes: int | None = _key(None, _OrNull(_Bytes(), "all the heap's budget"))
    matvec: str = _key("exact", _OneOf(("exact", "int8", "float")))
    coopmat: str = _key("auto", _OneOf(("auto", "off")))
    coopmat_min_tokens: int = _key(4, _Int(2))
    mmq: str = _key("auto", _OneOf(("auto", "off")))
    mmq_min_tokens: int = _key(3, _Int(2))
    fuse: bool = _key(True, _Bool())
    prefetch_bytes: int | None = _key(None, _OrNull(_Bytes(), "auto: 8 MiB on a discrete GPU, else 0"))
    step_timeout_s: float = _key(600.0, _Real(1.0))


@dataclass(frozen=True)
class NpuConfig:
    """Options of hmad.backends.npu.backend.NpuBackend (which also takes the cpu section's), same names."""

    enabled: str | bool = _key("auto", _Tristate())
    ops: tuple[str, ...] = _key(NPU_OPS, _Subset(NPU_OPS))
    xclbin_dir: str | None = _key(None, _OrNull(_Text(), "the kernels installed with hmad"))
    min_rows: int = _key(32, _Int(1))
    timeout_s: float = _key(5.0, _Real(0.0, 60.0, lo_open=True))
    idle_s: float = _key(5.0, _Real(0.0))


@dataclass(frozen=True)
class Config:
    """The whole configuration; ``load_config`` builds one, ``Config()`` is the built-in defaults."""

    model: str = _key("default", _Text("'default', a .gguf file or an HF checkpoint directory"))
    backend: str = _key("auto", _OneOf(("auto", "cpu", "vulkan", "npu")))
    log_level: str = _key("info", _OneOf(("debug", "info", "warning", "error")))
    socket: SocketConfig = _section(SocketConfig)
    engine: EngineConfig = _section(EngineConfig)
    limits: LimitsConfig = _section(LimitsConfig)
    server: ServerConfig = _section(ServerConfig)
    service: ServiceConfig = _section(ServiceConfig)
    sampling: SamplingConfig = _section(SamplingConfig)
    cpu: CpuConfig = _section(CpuConfig)
    vulkan: VulkanConfig = _section(VulkanConfig)
    npu: NpuConfig = _section(NpuConfig)
    source: str | None = field(default=None, compare=False)  # the YAML file read, if any

    def to_dict(self) -> dict[str, Any]:
        """Plain data (YAML/JSON-ready; socket.mode as "0660") that loads back to an equal Config."""
        out: dict[str, Any] = {}
        for f, check, section in _schema(Config):
            if section is None:
                out[f.name] = check.show(getattr(self, f.name))
            else:
                sec = getattr(self, f.name)
                out[f.name] = {g.name: c.show(getattr(sec, g.name)) for g, c, _ in _schema(section)}
        return out

    def scheduler_config(self) -> SchedulerConfig:
        from hmad.engine.scheduler import SchedulerConfig

        values = dataclasses.asdict(self.engine)
        del values["deterministic"]  # the backend's (backend_options), not the scheduler's
        return SchedulerConfig(**values)

    def sampling_defaults(self) -> SamplingParams:
        """A fresh SamplingParams (the scheduler edits its copy) holding the configured defaults."""
        from hmad.engine.sampling import SamplingParams

        values = dataclasses.asdict(self.sampling)
        return SamplingParams(**{**values, "stop": list(values["stop"])})

    def backend_options(self, name: str) -> dict[str, Any]:
        """Keyword options of backend ``name`` (cpu, vulkan, npu): its section as a dict, plus
        ``deterministic`` (engine.deterministic)."""
        if name not in ("cpu", "vulkan", "npu"):
            raise ValueError(f"no options section for backend {name!r} (allowed: cpu, vulkan, npu)")
        det = {"deterministic": self.engine.deterministic}
        if name == "npu":  # the CPU backend with NPU offload: both sections
            return {**dataclasses.asdict(self.cpu), **dataclasses.asdict(self.npu), **det}
        return {**dataclasses.asdict(getattr(self, name)), **det}


def _schema(cls: type) -> list[tuple[dataclasses.Field, _Check | None, type | None]]:
    """(field, check, section class) of every config key of ``cls``, in order."""
    out = []
    for f in dataclasses.fields(cls):
        if "check" in f.metadata or "section" in f.metadata:
            out.append((f, f.metadata.get("check"), f.metadata.get("section")))
    return out


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
        cfg = dataclasses.replace(cfg, socket=dataclasses.replace(cfg.socket, path=default_socket_path(env)))
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
            f"got {type(doc).__name__} {_show(doc)}"
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
    sections = {f.name for f, _, s in _schema(Config) if s is not None}
    nested: dict[str, Any] = {}
    for dotted, value in overrides.items():
        head, dot, rest = str(dotted).partition(".")
        if not dot:
            merge = isinstance(value, Mapping) and isinstance(nested.get(head), dict)
            nested[head] = {**nested[head], **value} if merge else value
        elif head in sections:
            sub = nested.setdefault(head, {})
            if not isinstance(sub, dict):
                raise ConfigError("given both as a whole and by key", key=head, origin=origin)
            sub[rest] = value
        else:
            raise _unknown(str(dotted), _names(Config), origin)
    return nested


def _parse_layer(raw: Mapping[str, Any], origin: str) -> dict[str, Any]:
    """Check one source's keys and values: {top-level key: value, section: {key: value}} (partial)."""
    fields = {f.name: (check, section) for f, check, section in _schema(Config)}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in fields:
            raise _unknown(str(key), list(fields), origin)
        check, section = fields[key]
        if section is None:
            out[key] = _parse_value(check, value, key, origin)
        else:
            out[key] = _parse_section(section, value, key, origin)
    return out


def _parse_section(cls: type, raw: Any, name: str, origin: str) -> dict[str, Any]:
    checks = {f.name: check for f, check, _ in _schema(cls)}
    if raw is None:
        return {}  # "engine:" with every key commented out
    if not isinstance(raw, Mapping):
        raise ConfigError(f"must be a mapping with keys {', '.join(checks)}, got {_show(raw)}", name, origin)
    out = {}
    for key, value in raw.items():
        if key not in checks:
            raise _unknown(f"{name}.{key}", list(checks), origin)
        out[key] = _parse_value(checks[key], value, f"{name}.{key}", origin)
    return out


def _parse_value(check: _Check, value: Any, key: str, origin: str) -> Any:
    try:
        return check.parse(value)
    except _Bad as bad:
        raise ConfigError(f"must be {check.describe()}, got {_show(value)}{bad.hint}", key, origin) from None


def _build(layers: list[dict[str, Any]], source: str | None) -> Config:
    """Defaults with each layer's keys laid over them, in order."""
    kwargs: dict[str, Any] = {}
    for f, _, section in _schema(Config):
        if section is None:
            for layer in layers:
                if f.name in layer:
                    kwargs[f.name] = layer[f.name]
        else:
            values: dict[str, Any] = {}
            for layer in layers:
                values.update(layer.get(f.name, {}))
            kwargs[f.name] = section(**values)
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
    if cfg.backend == "npu" and cfg.npu.enabled is False:
        raise ConfigError(
            "is false, but backend is npu (set npu.enabled: auto or true, or another backend)", "npu.enabled"
        )
    try:
        cfg.sampling_defaults().validate()  # SamplingParams' own rules, should the two ever drift apart
    except ValueError as e:
        raise ConfigError(str(e), "sampling") from None


def _unknown(dotted: str, allowed: list[str], origin: str) -> ConfigError:
    leaf = dotted.rpartition(".")[2]
    close = difflib.get_close_matches(leaf, allowed, n=1)
    guess = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"unknown key {dotted!r} (allowed: {', '.join(allowed)}{guess})", origin=origin)


def _names(cls: type) -> list[str]:
    return [f.name for f, _, _ in _schema(cls)]


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."
