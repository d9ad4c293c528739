"""Config: defaults, sources and their precedence, every class of bad value, YAML hygiene, etc/hmad.yaml."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
import yaml

from hmad import config as config_mod
from hmad.config import (
    Config,
    ConfigError,
    default_socket_path,
    load_config,
    parse_bytes,
    parse_override,
)
from hmad.core.errors import HmadError

REPO = Path(__file__).resolve().parent.parent
ENV = {"XDG_RUNTIME_DIR": "/run/user/1000"}


@pytest.fixture(autouse=True)
def no_system_config(monkeypatch, tmp_path):
    """Never read the machine's own /etc/hmad/hmad.yaml."""
    monkeypatch.setattr(config_mod, "SYSTEM_CONFIG", str(tmp_path / "absent" / "hmad.yaml"))


def _write(tmp_path: Path, text: str, name: str = "hmad.yaml") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def _error(tmp_path: Path | None = None, text: str | None = None, **overrides) -> str:
    """The message of the ConfigError raised by loading ``text`` (a YAML file) and/or ``overrides``."""
    path = _write(tmp_path, text) if text is not None else None
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides or None, env=ENV)
    return str(e.value)


# --- defaults -------------------------------------------------------------------------------------------


def test_defaults():
    cfg = load_config(env=ENV)
    assert cfg.source is None
    assert cfg.model == "default" and cfg.backend == "auto" and cfg.log_level == "info"
    assert cfg.socket == config_mod.SocketConfig(path=default_socket_path(ENV), mode=0o660, group=None)
    assert (cfg.engine.max_seqs, cfg.engine.kv_tokens, cfg.engine.max_queue) == (16, 32768, 256)
    assert cfg.limits.max_frame_bytes == 32 * 1024 * 1024
    assert cfg.service.heartbeat_timeout_s == 5.0 and cfg.service.watchdog is True
    s = cfg.sampling
    assert (s.temperature, s.top_k, s.top_p, s.min_p, s.max_tokens) == (1.0, 64, 0.95, 0.0, 512)
    assert cfg.cpu.weight_cache_bytes == 16 << 30
    assert cfg.npu.enabled == "auto" and cfg.npu.ops == ("attention_prefill", "gemm_int8", "gemm_bf16")
    assert cfg.model_copy(update={"socket": cfg.socket.model_copy(update={"path": None})}) == Config()


def _ids(v) -> str:
    return v if isinstance(v, str) else ""


def _keys():
    """(dotted key, section class, its leaf name) of every config key."""
    for name in ("model", "backend", "log_level"):
        yield name, Config, name
    for section, cls in config_mod._SECTIONS.items():
        for leaf in cls.model_fields:
            yield f"{section}.{leaf}", cls, leaf


@pytest.mark.parametrize("key, cls, leaf", list(_keys()), ids=_ids)
def test_each_default_passes_its_own_check_and_says_what_it_allows(key, cls, leaf):
    """A default, written out as to_dict writes it, loads back; every key's type says what it allows."""
    shown = cls().model_dump(mode="json")[leaf]
    assert getattr(cls.model_validate({leaf: shown}), leaf) == getattr(cls(), leaf)
    assert cls.model_fields[leaf].description


def test_sampling_section_is_the_one_table():
    """Keys, ranges and built-in defaults of sampling: are hmaclient.sampling's, in its words."""
    from hmaclient import sampling

    assert Config().sampling.model_dump() == {**sampling.DEFAULTS, "stop": []}
    for f in sampling.FIELDS:
        bad = "hot" if f.kind != "strings" else ["ok", ""]
        assert _error(**{f"sampling.{f.name}": bad}).startswith(
            f"sampling.{f.name}: must be {sampling.describe(f)}"
        )
    assert "a number in [0, 100]" in _error(**{"sampling.temperature": 100.5})  # capped as on the wire


def test_sections_mirror_the_classes_they_configure():
    from hmad.backends.cpu import CpuBackend
    from hmad.engine.sampling import SamplingParams
    from hmad.engine.scheduler import SchedulerConfig

    def names(cls):
        return (
            list(cls.model_fields)
            if hasattr(cls, "model_fields")
            else [f.name for f in dataclasses.fields(cls)]
        )

    # engine.deterministic goes to the backend (backend_options), every other engine key to the scheduler;
    # the scheduler's speculation comes from its own section
    assert names(config_mod.EngineConfig) == [*names(SchedulerConfig)[:-1], "deterministic"]
    assert names(SchedulerConfig)[-1] == "speculation"
    from hmad.engine.speculation import SpeculationConfig

    assert names(config_mod.SpeculationSection) == names(SpeculationConfig)
    from hmaclient.protocol import COUNT_FIELDS  # logprobs counts: asked per request, no config default

    assert sorted(names(config_mod.SamplingConfig)) == sorted(set(names(SamplingParams)) - set(COUNT_FIELDS))
    from hmad.backends.vulkan.options import VulkanOptions

    assert set(names(config_mod.VulkanConfig)) < set(names(VulkanOptions))  # its defaults are VulkanOptions'
    assert Config().vulkan.model_dump() == {
        k: getattr(VulkanOptions(), k) for k in names(config_mod.VulkanConfig)
    }
    cpu_keys = {*names(config_mod.CpuConfig), "deterministic"}
    assert cpu_keys == set(inspect.signature(CpuBackend).parameters)
    from hmad.backends.npu.backend import NpuBackend  # the CPU backend with NPU offload: both sections

    assert {*names(config_mod.NpuConfig), *cpu_keys} == set(inspect.signature(NpuBackend).parameters)
    for section, cls in (("cpu", CpuBackend), ("npu", NpuBackend)):  # defaults: the constructors'
        defaults = {k: p.default for k, p in inspect.signature(cls).parameters.items()}
        assert all(defaults[k] == v for k, v in getattr(Config(), section).model_dump().items())


def test_vision_section_is_the_image_limits(tmp_path):
    """vision: the limits of hmad.model.images (its defaults), under the names the messages give."""
    from hmad.model.images import ImageLimits

    assert Config().image_limits() == ImageLimits()
    assert Config().vision.model_dump() == {
        "max_image_bytes": 20 << 20,
        "max_image_pixels": 50_000_000,
        "max_images_per_request": 8,
        "image_cache_bytes": 256 << 20,  # hmad.engine.images.CACHE_BYTES
        "max_waiting_image_bytes": 1 << 30,  # hmad.engine.images.WAITING_BYTES
    }
    text = "vision:\n  max_image_bytes: 1MiB\n  max_image_pixels: 1000\n  max_images_per_request: 0\n"
    assert load_config(_write(tmp_path, text), env=ENV).image_limits() == ImageLimits(1 << 20, 1000, 0)
    cfg = load_config(
        overrides={"vision.max_image_bytes": "1KiB", "vision.max_image_pixels": 1 << 30}, env=ENV
    )
    assert cfg.image_limits() == ImageLimits(1024, 1 << 30, 8)  # the ranges' ends are allowed
    assert "unknown key 'vision.max_pixels'" in _error(**{"vision.max_pixels": 10})
    assert "did you mean 'max_image_pixels'?" in _error(**{"vision.max_pixels": 10})


def test_engine_deterministic_reaches_the_backend():
    from hmad.backends.cpu import CpuBackend
    from hmad.backends.npu.backend import NpuBackend

    assert load_config().backend_options("cpu")["deterministic"] == "auto"
    assert CpuBackend(**load_config().backend_options("cpu")).deterministic is CpuBackend.deterministic_auto
    on = load_config(overrides={"engine.deterministic": "true"})
    assert CpuBackend(**on.backend_options("cpu")).deterministic is True
    with pytest.raises(ValueError, match="npu backend is not batch-invariant"):
        NpuBackend(**on.backend_options("npu"))
    with pytest.raises(ConfigError, match="engine.deterministic: must be one of auto, true, false"):
        load_config(overrides={"engine.deterministic": "sometimes"})


def test_builds_scheduler_config_sampling_params_and_backend_options():
    from hmad.backends.cpu import CpuBackend
    from hmad.engine.scheduler import SchedulerConfig

    cfg = load_config(overrides={"engine.max_seqs": 4, "sampling.stop": ["\n\n"], "cpu.kv_dtype": "float16"})
    assert cfg.scheduler_config() == SchedulerConfig(max_seqs=4)
    params = cfg.sampling_defaults()
    assert (params.top_k, params.top_p, params.stop) == (64, 0.95, ["\n\n"])
    params.max_tokens = 1  # the scheduler edits its copy; the next request gets fresh defaults
    assert cfg.sampling_defaults().max_tokens == 512
    assert CpuBackend(**cfg.backend_options("cpu")).kv_dtype == "float16"
    with pytest.raises(ValueError, match="allowed: cpu, vulkan, npu"):
        cfg.backend_options("auto")


def test_to_dict_is_plain_data_that_loads_back(tmp_path):
    cfg = load_config(overrides={"socket.mode": "0640", "npu.ops": ["gemm_int8"], "vulkan.device": 1})
    d = cfg.to_dict()
    assert d["socket"]["mode"] == "0640" and d["npu"]["ops"] == ["gemm_int8"]
    assert load_config(_write(tmp_path, yaml.safe_dump(d)), env=ENV) == cfg


def test_example_config_equals_the_defaults():
    """etc/hmad.yaml documents every key at its default: it must not drift from config.py."""
    path = REPO / "etc" / "hmad.yaml"

    def shape(d):
        return {k: sorted(v) if isinstance(v, dict) else None for k, v in d.items()}

    assert shape(yaml.safe_load(path.read_text())) == shape(Config().to_dict())  # every key written out
    assert load_config(str(path), env=ENV) == load_config(env=ENV)


def test_example_sampling_comments_say_the_tables_ranges():
    """etc/hmad.yaml's sampling comments give each field's range in hmaclient.sampling's words."""
    from hmaclient import sampling

    text = " ".join((REPO / "etc" / "hmad.yaml").read_text().replace("#", " ").split())
    for f in sampling.FIELDS:
        assert sampling.describe(f).replace(" (fresh entropy)", "") in text, f.name


def test_every_example_key_has_a_comment_with_its_default():
    lines = (REPO / "etc" / "hmad.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.strip() and not line.lstrip().startswith("#") and not line.rstrip().endswith(":"):
            comment = []
            for prev in reversed(lines[:i]):
                if not prev.lstrip().startswith("#"):
                    break
                comment.append(prev)
            assert any("Default:" in c for c in comment), f"etc/hmad.yaml line {i + 1}: {line.strip()}"


# --- sources and precedence -----------------------------------------------------------------------------


def test_yaml_overrides_defaults_key_by_key(tmp_path):
    path = _write(tmp_path, "model: /m/g.gguf\nengine:\n  max_seqs: 8\ncpu:\n  weight_cache_bytes: 2GiB\n")
    cfg = load_config(path, env=ENV)
    assert cfg.source == path
    assert (cfg.model, cfg.engine.max_seqs, cfg.cpu.weight_cache_bytes) == ("/m/g.gguf", 8, 2 << 30)
    assert cfg.engine.step_tokens == 512 and cfg.cpu.numerics == "ggml"  # the rest stay at their defaults


def test_empty_file_and_empty_sections_mean_defaults(tmp_path):
    assert load_config(_write(tmp_path, ""), env=ENV) == load_config(env=ENV)
    path = _write(tmp_path, "engine:\nnpu:\n  # all commented\n")
    assert load_config(path, env=ENV) == load_config(env=ENV)


def test_env_hmad_config(tmp_path):
    path = _write(tmp_path, "backend: cpu\n")
    assert load_config(env={**ENV, "HMAD_CONFIG": path}).backend == "cpu"
    other = _write(tmp_path, "backend: vulkan\n", "other.yaml")
    assert load_config(other, env={**ENV, "HMAD_CONFIG": path}).backend == "vulkan"  # --config wins


def test_system_config_is_read_only_when_present(tmp_path, monkeypatch):
    assert load_config(env=ENV).source is None
    path = _write(tmp_path, "log_level: debug\n")
    monkeypatch.setattr(config_mod, "SYSTEM_CONFIG", path)
    assert load_config(env=ENV).log_level == "debug"
    assert load_config(env={**ENV, "HMAD_CONFIG": _write(tmp_path, "{}", "e.yaml")}).log_level == "info"


def test_missing_named_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file .*nope.yaml"):
        load_config(str(tmp_path / "nope.yaml"), env=ENV)
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(env={"HMAD_CONFIG": str(tmp_path / "nope.yaml")})


def test_flags_override_yaml(tmp_path):
    path = _write(tmp_path, "model: a.gguf\nbackend: cpu\nengine: {max_seqs: 8, step_tokens: 64}\n")
    flags = {"model": "b.gguf", "engine.max_seqs": 2, "socket.path": "/tmp/x/h.sock", "vulkan.device": None}
    cfg = load_config(path, flags, env=ENV)
    assert (cfg.model, cfg.backend, cfg.socket.path) == ("b.gguf", "cpu", "/tmp/x/h.sock")
    assert (cfg.engine.max_seqs, cfg.engine.step_tokens) == (2, 64)
    assert load_config(path, {"engine": {"max_seqs": 3}}, env=ENV).engine.step_tokens == 64  # merged


def test_default_socket_path_is_the_clients_rule():
    """One rule for daemon and clients: hmaclient.protocol.default_socket_path, $HMAD_SOCKET included."""
    from hmaclient import protocol as P

    assert default_socket_path({}, euid=0) == "/run/hmad/hmad.sock"
    assert default_socket_path({"HMAD_SOCKET": "/x/h.sock"}, euid=7) == "/x/h.sock"
    for env in ({}, {"XDG_RUNTIME_DIR": "/run/user/7"}, {"XDG_RUNTIME_DIR": "relative"}, {"TMPDIR": "/t"}):
        assert default_socket_path(env, euid=7) == P.default_socket_path(env, euid=7)
    assert load_config(overrides={}, env={"HMAD_SOCKET": "/y/h.sock"}).socket.path == "/y/h.sock"


def test_parse_override():
    assert parse_override("engine.max_seqs=32") == ("engine.max_seqs", 32)
    assert parse_override("vulkan.device=null") == ("vulkan.device", None)
    assert parse_override("npu.ops=[gemm_int8]") == ("npu.ops", ["gemm_int8"])
    assert parse_override("socket.mode=0660") == ("socket.mode", 0o660)
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("engine.max_seqs")


# --- bad values -----------------------------------------------------------------------------------------

BAD_VALUES = [
    # (dotted key, value, fragments the message must hold)
    ("engine.max_seqs", "many", ["must be an integer from 1 to 1024", "got 'many'"]),
    ("engine.max_seqs", 0, ["from 1 to 1024", "got 0"]),
    ("engine.max_seqs", 2000, ["from 1 to 1024", "got 2000"]),
    ("engine.max_seqs", True, ["an integer", "got True"]),
    ("engine.max_seqs", 16.0, ["an integer", "got 16.0"]),
    ("engine.block_size", 24, ["a power of two from 1 to 256", "got 24"]),
    ("engine.context_length", -1, ["an integer from 0 to", "got -1"]),
    ("backend", "cuda", ["one of auto, cpu, vulkan, npu", "got 'cuda'"]),
    ("log_level", "loud", ["one of debug, info, warning, error"]),
    ("cpu.numerics", "f16", ["one of ggml, f32"]),
    ("cpu.kv_dtype", "bfloat16", ["one of float32, float16"]),
    ("model", "", ["'default', a .gguf file or an HF checkpoint directory"]),
    ("model", 270, ["got 270", "quote it"]),
    ("service.watchdog", "yes please", ["true or false"]),
    ("service.drain_grace_s", -1, ["a number >= 0", "got -1"]),
    ("service.heartbeat_ivl_s", 0, ["a number > 0", "got 0"]),
    ("service.heartbeat_ivl_s", float("nan"), ["a number > 0", "got nan"]),
    ("sampling.temperature", "hot", ["a number in [0, 100]"]),
    ("sampling.top_p", 0, ["a number in (0, 1]"]),
    ("sampling.min_p", 1.5, ["a number in [0, 1]"]),
    ("sampling.seed", -3, ["an integer from 0 to 2^64-1, or null"]),
    ("sampling.stop", ["", "x"], ["a list of at most 16 strings of 1 to 256 characters"]),
    ("limits.max_frame_bytes", "2GiB", ["a byte size from 1KiB to 1GiB", "= 2147483648 bytes"]),
    ("limits.max_frame_bytes", "lots", ["a byte size", "units B, KiB, MiB, GiB, TiB", "got 'lots'"]),
    ("cpu.weight_cache_bytes", "8G", ["a byte size", "got '8G'"]),
    ("cpu.weight_cache_bytes", -1, ["a byte size"]),
    ("vulkan.device_local_bytes", "1.3B", ["a byte size", "or null"]),
    ("vulkan.device", -1, ["a device index >= 0, or a substring of the device name"]),
    ("vulkan.device", "", ["a device index"]),
    ("npu.enabled", "maybe", ["one of auto, true, false"]),
    ("npu.ops", ["gemm_fp4"], ["from attention_prefill, gemm_int8, gemm_bf16", "unknown: 'gemm_fp4'"]),
    ("npu.ops", ["gemm_int8", "gemm_int8"], ["distinct", "repeated"]),
    ("npu.ops", "gemm_int8", ["a list of distinct names"]),
    ("npu.xclbin_dir", 5, ["a non-empty string, or null"]),
    ("socket.path", "rel/hmad.sock", ["an absolute path of at most 107 bytes"]),
    ("socket.path", "/" + "x" * 120, ["longer than a Unix socket path can be"]),
    ("socket.group", 1000, ["a group name (a string)", "quote it"]),
    ("socket.mode", "rw-rw----", ["permission bits from 0000 to 0777"]),
    ("vision.max_image_bytes", "2GiB", ["a byte size from 1KiB to 1GiB", "= 2147483648 bytes"]),
    ("vision.max_image_bytes", 100, ["a byte size from 1KiB to 1GiB", "got 100 (= 100 bytes)"]),
    ("vision.max_image_bytes", "big", ["a byte size", "got 'big'"]),
    ("vision.max_image_pixels", 0, ["an integer from 1 to 1073741824", "got 0"]),
    ("vision.max_image_pixels", "50M", ["an integer from 1 to 1073741824", "got '50M'"]),
    ("vision.max_image_pixels", 5e7, ["an integer", "got 50000000.0"]),
    ("vision.max_images_per_request", -1, ["an integer from 0 to 1024", "got -1"]),
    ("vision.max_images_per_request", 2000, ["an integer from 0 to 1024", "got 2000"]),
    ("vision.max_images_per_request", True, ["an integer", "got True"]),
]


@pytest.mark.parametrize("key, value, fragments", BAD_VALUES, ids=_ids)
def test_bad_value_names_key_and_allowed_values_in_overrides(key, value, fragments):
    msg = _error(**{key: value})
    assert msg.startswith(f"{key}: must be ")
    assert msg.endswith("(in the command-line overrides)")
    for frag in fragments:
        assert frag in msg


@pytest.mark.parametrize("key, value, fragments", BAD_VALUES[:12], ids=_ids)
def test_bad_value_in_yaml_names_the_file(tmp_path, key, value, fragments):
    section, _, leaf = key.rpartition(".")
    doc = {section: {leaf: value}} if section else {key: value}
    msg = _error(tmp_path, yaml.safe_dump(doc))
    assert msg.startswith(f"{key}: must be ") and msg.endswith(f"(in {tmp_path / 'hmad.yaml'})")
    assert all(frag in msg for frag in fragments)


def test_section_that_is_not_a_mapping(tmp_path):
    msg = _error(tmp_path, "engine: 16\n")
    assert msg.startswith("engine: must be a mapping with keys max_seqs, step_tokens")
    assert "got 16" in msg


def test_keys_that_must_agree():
    msg = _error(**{"service.heartbeat_timeout_s": 1.0})
    assert msg == "service.heartbeat_timeout_s: must be greater than service.heartbeat_ivl_s (1), got 1"


def test_config_error_is_an_hmad_error_and_carries_the_key():
    with pytest.raises(HmadError) as e:
        load_config(overrides={"engine.max_seqs": 0})
    assert e.value.key == "engine.max_seqs"


# --- unknown keys ---------------------------------------------------------------------------------------


def test_unknown_top_level_key(tmp_path):
    msg = _error(tmp_path, "modle: x.gguf\n")
    assert msg.startswith("unknown key 'modle' (allowed: model, mmproj, chat_template, backend, log_level,")
    assert "did you mean 'model'?" in msg and msg.endswith(f"(in {tmp_path / 'hmad.yaml'})")


def test_unknown_nested_key(tmp_path):
    msg = _error(tmp_path, "engine:\n  max_seq: 4\n")
    assert msg.startswith("unknown key 'engine.max_seq' (allowed: max_seqs, step_tokens, max_chunk,")
    assert "did you mean 'max_seqs'?" in msg


def test_unknown_keys_in_overrides():
    msg = _error(**{"engine.max_seq": 4})
    assert "unknown key 'engine.max_seq'" in msg and "(in the command-line overrides)" in msg
    allowed = "unknown key 'nosuch.key' (allowed: model, mmproj, chat_template, backend,"
    assert allowed in _error(**{"nosuch.key": 1})
    assert "unknown key 'model.path'" in _error(**{"model.path": "x"})  # model is not a section
    assert "unknown key 'engine.a.b'" in _error(**{"engine.a.b": 1})


def test_yaml_boolean_key_is_unknown(tmp_path):
    assert "unknown key 'True'" in _error(tmp_path, "on: 1\n")  # YAML 1.1 reads `on` as true


# --- YAML hygiene ---------------------------------------------------------------------------------------


def test_duplicate_top_level_key(tmp_path):
    msg = _error(tmp_path, "model: a.gguf\nbackend: cpu\nmodel: b.gguf\n")
    assert msg == f"{tmp_path / 'hmad.yaml'}:3:1: invalid YAML: duplicate key 'model' (first at line 1)"


def test_duplicate_nested_key(tmp_path):
    msg = _error(tmp_path, "engine:\n  max_seqs: 4\n  step_tokens: 64\n  max_seqs: 8\n")
    assert msg.endswith(":4:3: invalid YAML: duplicate key 'max_seqs' (first at line 2)")


def test_same_key_in_different_sections_is_fine(tmp_path):
    load_config(_write(tmp_path, "vulkan: {device: null}\ncpu: {numerics: f32}\n"), env=ENV)


def test_syntax_error_shows_file_and_line(tmp_path):
    msg = _error(tmp_path, "model: default\nengine:\n  max_seqs: 4\n   step_tokens: 8\n")
    assert msg.startswith(f"{tmp_path / 'hmad.yaml'}:4:")
    assert "invalid YAML: mapping values are not allowed here" in msg
    msg = _error(tmp_path, "engine: {max_seqs: 4\n")
    assert msg.startswith(f"{tmp_path / 'hmad.yaml'}:2:") and "invalid YAML" in msg


@pytest.mark.parametrize("text, kind", [("- a\n- b\n", "list"), ("just words\n", "str"), ("42\n", "int")])
def test_document_must_be_a_mapping(tmp_path, text, kind):
    msg = _error(tmp_path, text)
    file = tmp_path / "hmad.yaml"
    keys = "(model, mmproj, chat_template, backend,"
    assert msg.startswith(f"{file}: the document must be a mapping of keys {keys}")
    assert f"got {kind}" in msg


def test_one_document_only(tmp_path):
    msg = _error(tmp_path, "model: a.gguf\n---\nmodel: b.gguf\n")
    problem = "expected a single document in the stream, but found another document"
    assert msg.endswith(f":2:1: invalid YAML: {problem}")


def test_unsafe_tags_are_refused(tmp_path):
    msg = _error(tmp_path, "model: !!python/object/apply:os.system ['true']\n")
    assert "invalid YAML" in msg and ":1:8:" in msg


# --- byte sizes and socket modes ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, n",
    [
        (0, 0),
        (4096, 4096),
        ("4096", 4096),
        ("512MiB", 512 << 20),
        ("8GiB", 8 << 30),
        ("8gib", 8 << 30),
        ("1.5GiB", 3 << 29),
        ("2 KiB", 2048),
        ("1TiB", 1 << 40),
        ("100B", 100),
        ("4MB", 4_000_000),
        ("1kB", 1000),
        ("2GB", 2_000_000_000),
    ],
)
def test_byte_sizes(text, n):
    assert parse_bytes(text) == n


@pytest.mark.parametrize("text", ["8G", "8 GiBs", "-1", -1, "1.3B", "0.5KiB0", "GiB", "", True, 1.5, None])
def test_bad_byte_sizes(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


def test_byte_size_in_yaml(tmp_path):
    path = _write(tmp_path, "limits: {max_frame_bytes: 64KiB}\nvulkan: {device_local_bytes: 512MiB}\n")
    cfg = load_config(path, env=ENV)
    assert (cfg.limits.max_frame_bytes, cfg.vulkan.device_local_bytes) == (64 << 10, 512 << 20)


@pytest.mark.parametrize("value", ["0660", "660", "0o660", 0o660, 432])
def test_socket_mode_accepted(value):
    assert load_config(overrides={"socket.mode": value}, env=ENV).socket.mode == 0o660


def test_socket_mode_edges_and_yaml_octal(tmp_path):
    assert load_config(overrides={"socket.mode": "0000"}, env=ENV).socket.mode == 0
    assert load_config(overrides={"socket.mode": 0o777}, env=ENV).socket.mode == 0o777
    yaml_octal = _write(tmp_path, "socket: {mode: 0600}\n")  # YAML 1.1 reads 0600 as octal
    assert load_config(yaml_octal, env=ENV).socket.mode == 0o600
    assert load_config(_write(tmp_path, "socket: {mode: '0640'}\n"), env=ENV).socket.mode == 0o640


@pytest.mark.parametrize(
    "value", [0o1777, "1777", "01777", "0o1777", "0x1b4", "0890", "rw-rw----", "66", "", -1, True, 6.6, None]
)
def test_socket_mode_refused(value):
    msg = _error(**{"socket.mode": value})
    assert msg.startswith("socket.mode: must be permission bits from 0000 to 0777, such as '0660', got ")


def test_unquoted_decimal_mode_gets_a_hint(tmp_path):
    msg = _error(tmp_path, "socket:\n  mode: 660\n")  # YAML reads 660 as decimal: 0o1224
    assert "got 660 (= 0o1224; did you mean '0660'?)" in msg
