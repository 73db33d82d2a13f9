"""The typed preset (``deployments.preset``): every bad value is refused where ``build_app`` runs,
with a ValueError naming the key and the value; the context length is one rule for the ingress
and the engine."""

from __future__ import annotations

import copy
import dataclasses
import logging
import pathlib
import re
import sys
from typing import Any

import pytest
import yaml

from deployments.preset import EnginePreset, ModelPreset, Preset, ServingPreset
from engine.demo import DemoModelSpec, ensure_demo_model

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = DemoModelSpec(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1,
)  # fmt: skip
BASE: dict[str, Any] = {
    "model": {"demo": {"seed": 1}, "dtype": "float32", "device": "cpu"},
    "engine": {"max_num_tokens": 4096, "page_size": 16, "max_chunk_size": 256},
    "serving": {"num_replicas": 2, "router": "prefix", "torch_threads": 1},
}


def with_value(section: str, key: str, value: Any) -> dict[str, Any]:
    raw = copy.deepcopy(BASE)
    raw[section][key] = value
    return raw


def test_every_shipped_preset_parses() -> None:
    for path in sorted((REPO_ROOT / "configs").glob("*.yaml")):
        preset = Preset.load(path)
        assert preset.source == str(path)
        assert isinstance(preset.engine, EnginePreset)


def test_demo_preset_values() -> None:
    preset = Preset.load("configs/demo.yaml")
    assert preset.model == ModelPreset(demo={"seed": 1234}, dtype="float32", device="cpu")
    assert preset.engine == EnginePreset(max_num_tokens=16384, page_size=16, max_chunk_size=512)
    assert preset.serving.num_replicas == 2 and preset.serving.router == "prefix"
    assert preset.model_id == "demo"


def test_defaults_when_sections_are_left_out() -> None:
    preset = Preset.parse({"model": {"demo": None}})
    assert preset.model.demo == {}
    assert preset.engine == EnginePreset() and preset.serving == ServingPreset()


@pytest.mark.parametrize(
    ("section", "key", "value", "message"),
    [
        ("engine", "max_num_tokens", -16, "engine.max_num_tokens must be >= 1, got -16"),
        ("engine", "max_num_tokens", 8, r"engine.max_num_tokens \(8\) must hold at least one page"),
        ("engine", "max_num_tokens", "4k", "engine.max_num_tokens must be an integer, got '4k'"),
        ("engine", "page_size", 12, "engine.page_size must be a power of two, got 12"),
        ("engine", "page_size", 0, "engine.page_size must be >= 1, got 0"),
        ("engine", "page_size", 16.0, "engine.page_size must be an integer, got 16.0"),
        ("engine", "max_chunk_size", True, "engine.max_chunk_size must be an integer, got True"),
        ("engine", "max_batch_size", 0, "engine.max_batch_size must be >= 1, got 0"),
        ("engine", "cache_quant", "q3", "engine.cache_quant 'q3' is not one of"),
        ("engine", "cache_rotate", True, "engine.cache_rotate: true needs a quantized"),
        ("engine", "cache_rotate", "on", "engine.cache_rotate must be true or false, got 'on'"),
        ("engine", "cache_center_keys", True, "engine.cache_center_keys: true needs a quantized"),
        ("engine", "cache_center_keys", 1, "engine.cache_center_keys must be true or false, got 1"),
        ("engine", "cache_sink_pages", 4, "engine.cache_sink_pages needs a quantized"),
        ("engine", "cache_sink_pages", -1, "engine.cache_sink_pages must be >= 0, got -1"),
        ("engine", "cache_recent_pages", 4, "engine.cache_recent_pages needs a quantized"),
        ("engine", "cache_recent_pages", -2, "engine.cache_recent_pages must be >= 0, got -2"),
        ("engine", "cache_exact_chunks", True, "engine.cache_exact_chunks: true needs a quantized"),
        ("engine", "cache_exact_chunks", "no", "engine.cache_exact_chunks must be true or false"),
        ("engine", "cuda_graphs", "yes", "engine.cuda_graphs must be true or false, got 'yes'"),
        (
            "engine",
            "async_scheduling",
            1,
            "engine.async_scheduling must be true or false, got 1",
        ),
        ("engine", "speculate", 4, r"unknown key\(s\) \['speculate'\] in 'engine'"),
        ("serving", "num_replicas", 0, "serving.num_replicas must be >= 1, got 0"),
        ("serving", "num_replicas", "2", "serving.num_replicas must be an integer, got '2'"),
        ("serving", "router", "random", "serving.router 'random' is not one of"),
        ("serving", "router_kwargs", [1], "serving.router_kwargs must be a mapping"),
        (
            "serving",
            "router_kwargs",
            {"max_load": 0},
            "serving.router_kwargs: router kwarg max_load must be >= 1, got 0",
        ),
        ("serving", "torch_threads", 0, "serving.torch_threads must be >= 1, got 0"),
        ("serving", "stream_interval_s", -1, "serving.stream_interval_s must be a number >= 0"),
        ("serving", "model_id", 7, "serving.model_id must be a non-empty string, got 7"),
        ("serving", "engine_cpus", [], r"serving.engine_cpus must name at least one core"),
        ("serving", "ingress_cpus", "0-", "serving.ingress_cpus '0-' is not a cpulist"),
        ("model", "dtype", "float8", "model.dtype 'float8' is not one of"),
        ("model", "device", "tpu", "model.device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
        ("model", "demo", {"colour": "red"}, "unknown model.demo keys: colour"),
        ("model", "path", "/models/x", "exactly one of 'demo', 'path' or 'package'"),
    ],
)
def test_bad_values_name_key_and_value(section: str, key: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message) as raised:
        Preset.parse(with_value(section, key, value), source="my.yaml")
    assert str(raised.value).startswith("my.yaml: ")


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([1, 2], "top level must be a mapping, got list"),
        ({"engine": {}}, "missing required section 'model'"),
        ({"model": {"demo": None}, "extra": {}}, r"unknown section\(s\) \['extra'\]"),
        ({"model": {"demo": None}, "engine": [1]}, "engine must be a mapping"),
        ({"model": {"dtype": "float32"}}, "exactly one of 'demo', 'path' or 'package', got none"),
        ({"model": {"path": None}}, "model.path must be a non-empty string, got None"),
    ],
)
def test_bad_shapes(raw: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Preset.parse(raw)


def test_engine_and_ingress_cores() -> None:
    raw = copy.deepcopy(BASE)
    raw["serving"].update(engine_cpus="1-2", ingress_cpus=[0])
    serving = Preset.parse(raw).serving
    assert serving.engine_cpus == (1, 2) and serving.ingress_cpus == (0,)
    raw["serving"]["ingress_cpus"] = [0, 2]
    with pytest.raises(ValueError, match=r"engine_cpus and serving.ingress_cpus share cores \[2\]"):
        Preset.parse(raw)


def test_load_errors_name_the_file(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="not found"):
        Preset.load(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [unclosed")
    with pytest.raises(ValueError, match=re.escape("broken.yaml: not valid YAML")):
        Preset.load(broken)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(with_value("engine", "page_size", 24)))
    with pytest.raises(
        ValueError, match=re.escape("bad.yaml: engine.page_size must be a power of two")
    ):
        Preset.load(bad)


def test_cache_quant_and_rotate_select_the_mode() -> None:
    raw = with_value("engine", "cache_quant", "q4")
    raw["engine"]["cache_rotate"] = False
    engine = Preset.parse(raw).engine
    assert (engine.cache_quant, engine.cache_rotate) == ("q4", False)
    assert Preset.parse(with_value("engine", "cache_quant", "q8")).engine.cache_rotate is None


def test_cache_center_keys_is_parsed_for_quantized_modes() -> None:
    raw = with_value("engine", "cache_quant", "q4")
    raw["engine"]["cache_center_keys"] = False
    assert Preset.parse(raw).engine.cache_center_keys is False
    assert Preset.parse(with_value("engine", "cache_quant", "q4")).engine.cache_center_keys is None


def test_cache_sink_pages_shorten_the_context_by_the_other_sink_pages() -> None:
    raw = with_value("engine", "max_num_tokens", 1024)
    raw["engine"].update(cache_quant="q4", cache_sink_pages=8)
    preset = Preset.parse(raw)
    assert preset.engine.cache_sink_pages == 8 and preset.cache_tokens() == 1024
    # one sink page (its first block) and the 56 ordinary pages: 57 pages of 16
    assert preset.context_length(max_position_embeddings=4096) == 57 * 16
    raw["engine"]["cache_sink_pages"] = 65
    with pytest.raises(ValueError, match=r"cache_sink_pages \(65\) and engine.cache_recent"):
        Preset.parse(raw).cache_pages()
    raw["engine"].update(cache_sink_pages=8, cache_recent_pages=1)
    with pytest.raises(ValueError, match="cache_recent_pages must be 0 or at least 2"):
        Preset.parse(raw)
    raw["engine"]["cache_recent_pages"] = 8  # (they hold no block: the context loses 8)
    assert Preset.parse(raw).context_length(max_position_embeddings=4096) == 49 * 16


@pytest.mark.parametrize(
    ("settings", "warned"),
    [
        ({"cache_quant": "q4"}, True),
        ({"cache_quant": "q4", "cache_sink_pages": 0}, False),
        ({"cache_quant": "q4", "cache_recent_pages": 0}, False),
        ({"cache_quant": "q4", "max_batch_size": 4, "cache_sink_pages": "auto"}, False),
        ({"cache_quant": "q8"}, False),
        ({"cache_quant": "fp16"}, False),
    ],
)
def test_q4_without_sink_or_recent_pages_is_warned_about(caplog, settings, warned) -> None:
    """They are opt-in, but q4 loses the most without them: a preset that leaves both unsaid
    is told how to turn them on or keep them off."""
    raw = with_value("engine", "max_num_tokens", 4096)
    raw["engine"].update(settings)
    serve_logger = logging.getLogger("ray.serve")  # (Ray stops it propagating once Serve ran)
    serve_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level("WARNING", logger="ray.serve"):
            Preset.parse(raw)
    finally:
        serve_logger.removeHandler(caplog.handler)
    advice = [r.getMessage() for r in caplog.records if "sink and recent pages" in r.getMessage()]
    assert bool(advice) == warned, advice
    if warned:
        assert "cache_sink_pages: auto" in advice[0] and "+5.6% of fp32's" in advice[0]


def test_cache_sink_and_recent_pages_auto_serve_every_running_sequence() -> None:
    raw = with_value("engine", "max_num_tokens", 4096)
    raw["engine"].update(cache_quant="q4", cache_sink_pages="auto", cache_recent_pages="auto")
    with pytest.raises(ValueError, match=r"cache_sink_pages: auto needs engine\.max_batch_size"):
        Preset.parse(raw)
    raw["engine"]["max_batch_size"] = 6
    engine = Preset.parse(raw).engine
    assert (engine.cache_sink_pages, engine.cache_recent_pages) == (6, 12)
    raw["engine"]["cache_sink_pages"] = 0
    engine = Preset.parse(raw).engine
    assert (engine.cache_sink_pages, engine.cache_recent_pages) == (0, 12)
    raw["engine"]["cache_recent_pages"] = "some"
    with pytest.raises(ValueError, match="cache_recent_pages must be an integer, got 'some'"):
        Preset.parse(raw)
    raw["engine"].update(cache_quant="fp16", cache_recent_pages="auto")
    with pytest.raises(ValueError, match="cache_recent_pages needs a quantized"):
        Preset.parse(raw)


def test_cache_not_a_multiple_of_the_page_size_rounds_once() -> None:
    preset = Preset.parse(with_value("engine", "max_num_tokens", 1000))
    assert preset.cache_tokens() == 992
    assert preset.context_length(max_position_embeddings=4096) == 992
    assert preset.context_length(max_position_embeddings=512) == 512


def test_context_length_is_the_same_in_ingress_and_engine(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache of 1000 tokens in pages of 16: the ingress and a replica's generator both see
    992 (the ingress used to say 1000)."""
    from deployments.ingress import PromptBuilder
    from engine import DynamicGenerator, Model, PagedCache, Tokenizer

    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    raw = with_value("engine", "max_num_tokens", 1000)
    raw["model"]["demo"] = dataclasses.asdict(TINY)
    preset = Preset.parse(raw)
    builder = PromptBuilder(preset)
    path = preset.model.resolve_path()
    model = Model.from_pretrained(path, device="cpu")
    cache = PagedCache(model, preset.engine.max_num_tokens, preset.engine.page_size)
    generator = DynamicGenerator(
        model,
        cache,
        Tokenizer.from_pretrained(path),
        max_seq_len=preset.context_length(model.config.max_position_embeddings),
    )
    assert builder.context_length == generator.max_seq_len == cache.max_num_tokens == 992


def _budgeted(cache_bytes: Any, **engine: Any) -> dict[str, Any]:
    raw = copy.deepcopy(BASE)
    del raw["engine"]["max_num_tokens"]
    raw["engine"].update(cache_bytes=cache_bytes, **engine)
    raw["model"]["demo"] = dataclasses.asdict(TINY)
    return raw


def test_cache_bytes_and_max_num_tokens_are_exclusive() -> None:
    raw = with_value("engine", "cache_bytes", "1GiB")
    with pytest.raises(ValueError, match="either max_num_tokens or cache_bytes, not both"):
        Preset.parse(raw, source="my.yaml")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("4 gigs", "engine.cache_bytes '4 gigs' has an unknown unit 'gigs'"),
        ("lots", "engine.cache_bytes must be a byte count or a size like '4GiB', got 'lots'"),
        (0, "engine.cache_bytes must be at least 1 byte, got 0"),
        (None, "engine.cache_bytes must be a byte count or a size like '4GiB', got None"),
    ],
)
def test_bad_cache_bytes_name_the_value(value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"my.yaml: {message}")):
        Preset.parse(_budgeted(value), source="my.yaml")


def test_cache_bytes_give_a_quantized_cache_more_tokens(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same byte budget, sized by the model's bytes per token in each mode: q4 (4.5 bits
    per element with its scales) holds >= 3.5x the tokens of an fp16 cache."""
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    tokens = {}
    for quant in ("fp16", "q8", "q4"):
        raw = _budgeted("1MiB", cache_quant=quant)
        raw["model"]["dtype"] = "float16"
        preset = Preset.parse(raw)
        assert preset.engine.cache_bytes == 2**20 and preset.engine.max_num_tokens is None
        tokens[quant] = preset.cache_tokens()
        assert tokens[quant] * preset.kv_bytes_per_token() <= 2**20
    # TINY: 1 layer, 1 KV head of 32 dims: fp16 K+V is 128 bytes per token
    assert tokens["fp16"] == 2**20 // 128
    assert tokens["q8"] >= 1.8 * tokens["fp16"]
    assert tokens["q4"] >= 3.5 * tokens["fp16"]


def test_cache_bytes_size_the_replica_like_the_ingress(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replica sizes its cache with ``PagedCache.from_budget``; the ingress's context length
    comes from the preset: both give the same tokens for a budget that is no whole page count."""
    from deployments.ingress import PromptBuilder
    from deployments.llm_server import _build_cache
    from engine import Model

    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    preset = Preset.parse(_budgeted(100_000, cache_quant="q4", max_batch_size=None))
    model = Model.from_pretrained(preset.model.resolve_path(), device="cpu", dtype="float32")
    cache = _build_cache(model, preset)
    assert cache.quant == "q4" and cache.num_bytes() <= 100_000
    assert cache.num_bytes() + cache.page_size * cache.bytes_per_token() > 100_000
    assert PromptBuilder(preset).context_length == cache.max_num_tokens == preset.cache_tokens()
    assert preset.batch_size_estimate() == cache.num_pages // 2


def test_cache_bytes_with_sink_pages_size_the_replica_like_the_ingress(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sink pages' unquantized rows come out of the budget; the ingress's context length is
    what one sequence can hold (its sink page and the ordinary pages), as in the generator."""
    from deployments.ingress import PromptBuilder
    from deployments.llm_server import _build_cache
    from engine import DynamicGenerator, Model, Tokenizer

    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    budget = _budgeted(100_000, cache_quant="q4", cache_sink_pages=4, cache_recent_pages=4)
    preset = Preset.parse(budget)
    path = preset.model.resolve_path()
    model = Model.from_pretrained(path, device="cpu", dtype="float32")
    cache = _build_cache(model, preset)
    assert (cache.sink_pages, cache.recent_pages) == (4, 4) and cache.num_bytes() <= 100_000
    assert cache.num_pages == preset.cache_pages()
    generator = DynamicGenerator(model, cache, Tokenizer.from_pretrained(path))
    assert PromptBuilder(preset).context_length == generator.max_seq_len
    # one sink page and the ordinary pages (recent pages stand in for ordinary spares)
    assert generator.max_seq_len == (cache.num_pages - 3 - 4) * cache.page_size


def test_a_budget_below_one_page_is_refused(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    preset = Preset.parse(_budgeted("1KiB"))
    with pytest.raises(
        ValueError, match=re.escape("engine.cache_bytes: a budget of 1024 bytes holds no")
    ):
        preset.cache_tokens()


def test_resolve_demo_path(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    model = ModelPreset.parse({"demo": dataclasses.asdict(TINY)})
    assert model.resolve_path() == ensure_demo_model(TINY, cache_dir=tmp_path)


def test_resolve_local_path(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "m").mkdir()
    model = ModelPreset.parse({"path": "~/m"})
    assert model.resolve_path() == tmp_path / "m"
    assert model.default_model_id == "m"
    with pytest.raises(ValueError, match=re.escape("model.path '~/nowhere' does not exist")):
        ModelPreset.parse({"path": "~/nowhere"}).resolve_path()


def test_resolve_packaged_gguf(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "fake_model_pkg"
    package.mkdir()
    # The package's __init__ must never run (a model wheel's may import what is not installed).
    (package / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    (package / "Tiny-Model.Q8_0.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    model = ModelPreset.parse({"package": "fake_model_pkg"})
    assert model.resolve_path() == package / "Tiny-Model.Q8_0.gguf"
    assert "fake_model_pkg" not in sys.modules
    (package / "Other.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=re.escape("ships 2 .gguf files, not one")):
        model.resolve_path()
    with pytest.raises(ValueError, match="'no_such_model_pkg' is not installed"):
        ModelPreset.parse({"package": "no_such_model_pkg"}).resolve_path()


def _autoscaled(autoscaling: Any, engine: dict[str, Any] | None = None) -> dict[str, Any]:
    raw = copy.deepcopy(BASE)
    del raw["serving"]["num_replicas"]
    raw["serving"]["autoscaling"] = autoscaling
    raw["engine"].update(engine or {})
    return raw


def test_autoscaling_becomes_the_deployments_autoscaling_config() -> None:
    raw = _autoscaled({"min_replicas": 1, "max_replicas": 4, "upscale_delay_s": 3})
    preset = Preset.parse(raw)
    config = preset.serving.autoscaling.serve_config(preset.batch_size_estimate)
    assert config["min_replicas"] == 1 and config["max_replicas"] == 4
    assert config["upscale_delay_s"] == 3.0
    # 4096 tokens of 16-token pages: the engine batches 128 sequences, the target is half.
    assert config["target_ongoing_requests"] == 64
    explicit = Preset.parse(_autoscaled({"max_replicas": 2}, {"max_batch_size": 10}))
    assert (
        explicit.serving.autoscaling.serve_config(explicit.batch_size_estimate)[
            "target_ongoing_requests"
        ]
        == 5
    )
    from ray.serve.config import AutoscalingConfig

    AutoscalingConfig(**config)  # Serve accepts every key we give it

    from deployments.app import llm_deployment

    options = llm_deployment(preset)._deployment_config.autoscaling_config
    assert options is not None and options.max_replicas == 4


@pytest.mark.parametrize(
    ("autoscaling", "message"),
    [
        ({"min_replicas": 3, "max_replicas": 2}, "min_replicas (3) exceeds max_replicas (2)"),
        ({"max_replicas": 2, "initial_replicas": 5}, "initial_replicas (5) must be in [1, 2]"),
        ({"target_ongoing_requests": 0}, "target_ongoing_requests must be > 0"),
        ({"max_replicas": 0}, "max_replicas must be >= 1"),
        ({"upscale_delay_s": -1}, "upscale_delay_s must be a number >= 0"),
        ({"metrics_interval_s": 0}, "metrics_interval_s must be > 0"),
        ({"max_replicsa": 2}, "unknown key(s) ['max_replicsa']"),
        ([1, 2], "serving.autoscaling must be a mapping"),
    ],
)
def test_bad_autoscaling_is_refused(autoscaling: Any, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        Preset.parse(_autoscaled(autoscaling))


def test_replica_count_and_autoscaling_together_are_refused() -> None:
    raw = _autoscaled({"max_replicas": 2})
    raw["serving"]["num_replicas"] = 2
    with pytest.raises(ValueError, match="either num_replicas or autoscaling"):
        Preset.parse(raw)


@pytest.mark.parametrize(
    "path", ["serve_config.yaml", "configs/serve/gpu.yaml", "configs/serve/cpu-autoscale.yaml"]
)
def test_serve_configs_validate_and_name_a_valid_preset(path: str) -> None:
    """Each shipped serve config is a valid Serve schema whose preset loads; an autoscaled
    preset's LLMServer entry sets no replica count that would fight the autoscaler, and the
    ingress never reserves a CPU."""
    from ray.serve.schema import ServeDeploySchema

    raw = yaml.safe_load((REPO_ROOT / path).read_text())
    schema = ServeDeploySchema.model_validate(raw)
    app = schema.applications[0]
    preset = Preset.load(app.args["config"])
    entries = {d.name: d for d in app.deployments}
    assert entries["Ingress"].ray_actor_options.num_cpus == 0
    if preset.serving.autoscaling is not None:
        assert "num_replicas" not in raw["applications"][0]["deployments"][1]


def test_async_scheduling_reaches_the_replicas_generator(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from deployments.llm_server import build_generator

    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    for value in (True, False):
        preset = Preset.parse(with_value("engine", "async_scheduling", value))
        assert preset.engine.async_scheduling is value
        assert build_generator(preset).generator.async_scheduling is value
    assert Preset.parse(BASE).engine.async_scheduling is None  # the engine's default
    speculating = with_value("engine", "async_scheduling", True)
    speculating["engine"]["speculative"] = {"ngram": {}}
    with pytest.raises(ValueError, match=re.escape("engine.async_scheduling: true cannot be")):
        Preset.parse(speculating)
