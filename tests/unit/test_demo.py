"""The demo model: files, HF compatibility, tokenizer, determinism, caching and config presets."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

from engine import demo
from engine.demo import DemoModelSpec, ensure_demo_model

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
# A tiny spec for tests that only exercise the build/caching logic, not the default shapes.
TINY = DemoModelSpec(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1,
)  # fmt: skip


def _sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("pagedserve-cache")


@pytest.fixture(scope="module")
def model_dir(cache_dir: pathlib.Path) -> pathlib.Path:
    return ensure_demo_model(cache_dir=cache_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir: pathlib.Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(model_dir)


# --- files -------------------------------------------------------------------------------------


def test_folder_layout(model_dir: pathlib.Path, cache_dir: pathlib.Path) -> None:
    assert model_dir.parent == cache_dir
    assert model_dir.name == f"demo-{demo.spec_digest(DemoModelSpec())}"
    for name in demo.REQUIRED_FILES:
        assert (model_dir / name).is_file(), name
    # No temp leftovers next to the published folder.
    assert [p.name for p in cache_dir.iterdir()] == [model_dir.name]


def test_config_files(model_dir: pathlib.Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["torch_dtype"] == config["dtype"] == "float32"
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, 1)
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1, 3]  # <|end_of_text|>, <|im_end|>
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tok_config["bos_token"] == "<|begin_of_text|>"
    assert tok_config["eos_token"] == "<|end_of_text|>"


def test_weights_layout(model_dir: pathlib.Path) -> None:
    from safetensors.torch import load_file

    spec = DemoModelSpec()
    tensors = load_file(model_dir / "model.safetensors")
    assert set(tensors) == {name for name, _ in demo._tensor_shapes(spec)}
    assert "lm_head.weight" in tensors and "model.layers.5.mlp.down_proj.weight" in tensors
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert torch.equal(tensors["model.norm.weight"], torch.ones(spec.hidden_size))
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert abs(q.std().item() - 0.02) < 0.001 and abs(q.mean().item()) < 0.001
    total = sum(t.numel() for t in tensors.values())
    assert total == spec.num_parameters() == 12_587_904
    assert 10_000_000 <= total <= 30_000_000


# --- transformers compatibility ------------------------------------------------------------------


def test_transformers_loads_model(model_dir: pathlib.Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.from_pretrained(model_dir)
    assert config.model_type == "llama" and config.vocab_size == 4096
    model, info = transformers.LlamaForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    assert sum(p.numel() for p in model.parameters()) == DemoModelSpec().num_parameters()
    with torch.no_grad():
        logits = model(torch.tensor([[0, 2, 300, 1200, 3]])).logits
    assert logits.shape == (1, 5, 4096)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! The 42 quick brown foxes   jump.\n\tdef f(x): return x ** 2",
        "日本語のテキストと中文文本",
        "emoji 🙂👍🏽🇫🇷 and a zero-width joiner 👩‍💻",
        " leading space, trailing space ",
    ],
)
def test_tokenizer_round_trip(hf_tokenizer, text: str) -> None:
    ids = hf_tokenizer.encode(text)
    assert hf_tokenizer.decode(ids) == text


def test_tokenizer_specials_and_size(hf_tokenizer, model_dir: pathlib.Path) -> None:
    assert hf_tokenizer.convert_ids_to_tokens([0, 1, 2, 3]) == list(demo.SPECIAL_TOKENS)
    assert hf_tokenizer.bos_token_id == 0 and hf_tokenizer.eos_token_id == 1
    # Special tokens in text are single ids, not byte soup.
    assert hf_tokenizer.encode("<|im_start|>user<|im_end|>")[0] == 2
    config = json.loads((model_dir / "config.json").read_text())
    # The embedding must cover every id the tokenizer can produce.
    assert len(hf_tokenizer) <= config["vocab_size"]
    assert len(hf_tokenizer) > 1000  # a real BPE with merges, not bytes only


def test_chat_template(hf_tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
    ]
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = hf_tokenizer.apply_chat_template(messages, tokenize=False)
    assert not no_prompt.endswith("assistant\n")


# --- determinism and caching ------------------------------------------------------------------


def test_deterministic_across_processes(model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    # A separate process has fresh hash seeds and thread scheduling: the strongest check we can do.
    code = (
        "import sys; from engine.demo import ensure_demo_model; "
        "print(ensure_demo_model(cache_dir=sys.argv[1]))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], env=env, check=True, capture_output=True,
        text=True,
    )  # fmt: skip
    other = pathlib.Path(out.stdout.strip().splitlines()[-1])
    assert other != model_dir and other.name == model_dir.name
    for name in demo.REQUIRED_FILES:
        assert _sha256(other / name) == _sha256(model_dir / name), name


def test_deterministic_in_process(tmp_path: pathlib.Path) -> None:
    first = ensure_demo_model(TINY, cache_dir=tmp_path / "a")
    second = ensure_demo_model(TINY, cache_dir=tmp_path / "b")
    for name in ("tokenizer.json", "model.safetensors"):
        assert _sha256(first / name) == _sha256(second / name)


def test_seed_changes_weights_and_folder(tmp_path: pathlib.Path) -> None:
    other = dataclasses.replace(TINY, seed=7)
    a, b = ensure_demo_model(TINY, cache_dir=tmp_path), ensure_demo_model(other, cache_dir=tmp_path)
    assert a != b
    assert _sha256(a / "model.safetensors") != _sha256(b / "model.safetensors")
    assert _sha256(a / "tokenizer.json") == _sha256(b / "tokenizer.json")


def test_second_call_does_not_rebuild(
    model_dir: pathlib.Path, cache_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}

    def fail(*args: object) -> None:
        raise AssertionError("rebuilt an existing demo model")

    monkeypatch.setattr(demo, "_write_model", fail)
    assert ensure_demo_model(DemoModelSpec(), cache_dir=cache_dir) == model_dir
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == before


def test_cache_dir_from_env(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "env-cache"))
    assert demo.default_cache_dir() == tmp_path / "env-cache"
    assert ensure_demo_model(TINY).parent == tmp_path / "env-cache"
    monkeypatch.delenv("PAGEDSERVE_CACHE")
    assert demo.default_cache_dir() == pathlib.Path.home() / ".cache" / "pagedserve"


def test_crash_leaves_no_folder(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(spec: DemoModelSpec) -> dict[str, torch.Tensor]:
        raise KeyboardInterrupt  # e.g. Ctrl-C halfway through the build

    with monkeypatch.context() as patch:
        patch.setattr(demo, "build_weights", crash)
        with pytest.raises(KeyboardInterrupt):
            ensure_demo_model(TINY, cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []
    assert demo._is_complete(ensure_demo_model(TINY, cache_dir=tmp_path))


def test_incomplete_folder_is_rebuilt(tmp_path: pathlib.Path) -> None:
    broken = tmp_path / f"demo-{demo.spec_digest(TINY)}"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    assert ensure_demo_model(TINY, cache_dir=tmp_path) == broken
    assert demo._is_complete(broken)
    assert [p.name for p in tmp_path.iterdir()] == [broken.name]


def test_losing_the_race_uses_the_winner(tmp_path: pathlib.Path) -> None:
    winner = ensure_demo_model(TINY, cache_dir=tmp_path)
    loser = tmp_path / f".{winner.name}.tmp-loser"
    shutil.copytree(winner, loser)
    assert demo._publish(loser, winner) == winner
    assert not loser.exists() and demo._is_complete(winner)


# --- spec validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_attention_heads": 5}, "num_attention_heads=5"),
        ({"num_key_value_heads": 4}, "num_key_value_heads=4"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"vocab_size": 100}, "vocab_size=100"),
        ({"seed": -1}, "seed"),
        ({"num_hidden_layers": True}, "num_hidden_layers"),
        ({"rope_theta": "5e5"}, "rope_theta"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
        ({"rope_theta": float("inf")}, "rope_theta"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
        ({"hidden_size": 390, "num_attention_heads": 6, "num_key_value_heads": 1}, "head_dim"),
    ],
)
def test_spec_validation(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DemoModelSpec(**overrides)


def test_spec_normalises_numbers() -> None:
    spec = DemoModelSpec(rope_theta=500000)
    assert isinstance(spec.rope_theta, float)
    assert demo.spec_digest(spec) == demo.spec_digest(DemoModelSpec())


def test_tied_embeddings_omit_lm_head(tmp_path: pathlib.Path) -> None:
    transformers = pytest.importorskip("transformers")
    spec = dataclasses.replace(TINY, tie_word_embeddings=True)
    folder = ensure_demo_model(spec, cache_dir=tmp_path)
    _, info = transformers.LlamaForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


# --- presets name the demo model by its spec ------------------------------------------------------


def test_demo_spec_from_preset_overrides() -> None:
    assert demo.demo_spec(None) == demo.demo_spec(True) == demo.demo_spec({}) == DemoModelSpec()
    assert demo.demo_spec(dataclasses.asdict(TINY)) == TINY


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"seed": 1, "layers": 2, "colour": "red"}, "colour, layers"),
        ([1, 2], "mapping"),
        ({"num_attention_heads": 5}, "num_attention_heads=5"),
    ],
)
def test_demo_spec_errors(overrides: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        demo.demo_spec(overrides)


def test_corpus_is_packaged() -> None:
    # pyproject ships *.txt as package data; the file must sit inside the package.
    corpus = pathlib.Path(demo.__file__).with_name("demo_corpus.txt")
    assert 5_000 <= len(corpus.read_bytes()) <= 10_000
    assert 'engine = ["*.txt"]' in (REPO_ROOT / "pyproject.toml").read_text()
