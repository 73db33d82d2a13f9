"""Per-job embeddings on a tiny random model: encoding, validation, the embedding step,
outputs, and prefix caching by content identity (engine and the router's hash function)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import DynamicJob, MMEmbedding, SamplerSettings
from engine.batch import SequenceInput, build_forward_batch
from engine.cache.prefix_hash import prefix_hashes
from engine.embeddings import EMBEDDING_ID_BASE
from engine.model.cuda_graphs import DecodeGraphs
from engine.ops import OPS_ENV
from tests.engine.conftest import assert_no_pages_in_use
from tests.engine.test_cuda_ops import small  # noqa: F401 - fixture

PAGE = 4
GREEDY = SamplerSettings.greedy()


def _rows(tiny, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    hidden = tiny.model.config.hidden_size
    return torch.randn(n, hidden, generator=g).to(tiny.model.dtype)


def _encode(tiny, text: str, embeddings) -> list[int]:
    return tiny.tokenizer.encode(text, embeddings=embeddings)[0].tolist()


def _run(generator, jobs: list[DynamicJob]) -> list[dict]:
    """Run jobs to the end; the final result of each, in order."""
    for job in jobs:
        generator.enqueue(job)
    finals = {}
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            if result["eos"]:
                finals[id(result["job"])] = result
    assert_no_pages_in_use(generator)
    return [finals[id(job)] for job in jobs]


def _job(ids, embeddings=(), **kwargs) -> DynamicJob:
    kwargs.setdefault("gen_settings", GREEDY)
    return DynamicJob(ids, 6, stop_conditions=[], embeddings=embeddings, **kwargs)


def _first_logits(generator, ids, embeddings=()) -> tuple[torch.Tensor, list[int], dict]:
    job = _job(ids, embeddings, return_logits=True)
    logits = []
    generator.enqueue(job)
    final = None
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            if result["job"] is job and "logits" in result:
                logits.append(result["logits"])
            if result["job"] is job and result["eos"]:
                final = result
    return logits[0], job.new_token_ids, final


# -- containers and encoding ---------------------------------------------------------------


def test_containers_get_disjoint_placeholder_ranges_and_content_identities(tiny):
    rows = _rows(tiny, 5, 0)
    a, b, c = MMEmbedding(rows), MMEmbedding(rows.clone()), MMEmbedding(_rows(tiny, 5, 1))
    assert len({a.text_alias, b.text_alias, c.text_alias}) == 3
    ranges = [set(e.placeholder_ids) for e in (a, b, c)]
    assert all(min(r) >= EMBEDDING_ID_BASE and len(r) == 5 for r in ranges)
    assert not (ranges[0] & ranges[1]) and not (ranges[1] & ranges[2])
    assert a.identity == b.identity != c.identity
    assert MMEmbedding(rows[:4]).identity != a.identity


def test_encode_replaces_each_alias_with_its_placeholder_ids(tiny):
    a, b = MMEmbedding(_rows(tiny, 3, 0)), MMEmbedding(_rows(tiny, 2, 1))
    text = f"look {a.text_alias} and {b.text_alias}!"
    ids = _encode(tiny, text, [b, a])  # order of the list does not matter
    tok = tiny.tokenizer
    expected = (
        tok.encode("look ")[0].tolist()
        + list(a.placeholder_ids)
        + tok.encode(" and ")[0].tolist()
        + list(b.placeholder_ids)
        + tok.encode("!")[0].tolist()
    )
    assert ids == expected
    with_bos = tok.encode(text, add_bos=True, embeddings=[a, b])[0].tolist()
    assert with_bos == [tok.bos_token_id, *expected]
    # no embeddings and no alias: the plain encoding
    assert _encode(tiny, "plain text", []) == tok.encode("plain text")[0].tolist()


def test_encode_validation(tiny):
    a, b = MMEmbedding(_rows(tiny, 3, 0)), MMEmbedding(_rows(tiny, 2, 1))
    with pytest.raises(ValueError, match="its embedding is not given"):
        _encode(tiny, f"x {a.text_alias} {b.text_alias}", [a])
    with pytest.raises(ValueError, match="aliases are not in the text"):
        _encode(tiny, f"x {a.text_alias}", [a, b])
    with pytest.raises(ValueError, match="given twice"):
        _encode(tiny, f"x {a.text_alias}", [a, a])
    with pytest.raises(ValueError, match="one str"):
        tiny.tokenizer.encode([a.text_alias], embeddings=[a])
    with pytest.raises(ValueError, match="MMEmbedding"):
        _encode(tiny, "x", [torch.zeros(2, 4)])


def test_container_and_job_validation(tiny):
    model = tiny.model
    hidden = model.config.hidden_size
    with pytest.raises(ValueError, match="2-d"):
        MMEmbedding(torch.zeros(hidden))
    with pytest.raises(ValueError, match="at least one row"):
        MMEmbedding(torch.zeros(0, hidden))
    with pytest.raises(ValueError, match="hidden size"):
        MMEmbedding(torch.zeros(2, hidden + 1, dtype=model.dtype), model=model)
    with pytest.raises(ValueError, match="convert the rows"):
        MMEmbedding(torch.zeros(2, hidden, dtype=torch.float64), model=model)
    generator = tiny.generator(page_size=PAGE)
    text = "hello {}"
    wrong_size = MMEmbedding(torch.zeros(2, hidden + 1, dtype=model.dtype))
    wrong_dtype = MMEmbedding(torch.zeros(2, hidden, dtype=torch.float64))
    for bad in (wrong_size, wrong_dtype):
        ids = _encode(tiny, text.format(bad.text_alias), [bad])
        with pytest.raises(ValueError, match=r"hidden size|convert the rows"):
            generator.enqueue(_job(ids, [bad]))
    good, other = MMEmbedding(_rows(tiny, 2, 0)), MMEmbedding(_rows(tiny, 2, 1))
    ids = _encode(tiny, text.format(good.text_alias), [good])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generator.enqueue(_job(ids))  # placeholders without their container
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generator.enqueue(_job(ids, [other]))  # another container's ids
    with pytest.raises(ValueError, match="no placeholder ids"):
        generator.enqueue(_job(ids, [good, other]))  # a container the prompt never uses
    with pytest.raises(ValueError, match="overlap"):
        generator.enqueue(_job(ids, [good, good]))
    assert_no_pages_in_use(generator)


# -- the embedding step --------------------------------------------------------------------


def test_embedding_rows_reach_the_model_exactly(tiny):
    network = tiny.model.network
    a, b = MMEmbedding(_rows(tiny, 3, 0)), MMEmbedding(_rows(tiny, 4, 1))
    seq_a = [5, *a.placeholder_ids, 9, 11]
    seq_b = [*b.placeholder_ids[:2], 7, *b.placeholder_ids[2:], *a.placeholder_ids[:1]]
    rows = [
        SequenceInput(seq_a, 0, [0, 1], embeddings=[a]),
        SequenceInput([3, 4], 0, [2]),  # a plain row in the same batch
        SequenceInput(seq_b, 2, [3, 4], embeddings=[a, b]),  # after 2 cached tokens
    ]
    batch = build_forward_batch(rows, PAGE)
    got = network.embed_tokens(batch)

    def manual(ids, containers):
        out = []
        for t in ids:
            hit = [e.embeddings[t - e.first_id] for e in containers if t in e.placeholder_ids]
            out.append(hit[0] if hit else F.embedding(torch.tensor(t), network.embed))
        return torch.stack(out)

    expected = torch.cat([manual(seq_a, [a]), manual([3, 4], []), manual(seq_b, [a, b])])
    assert torch.equal(got, expected)
    # A batch without placeholders carries no table; a row with containers but no placeholder
    # in its chunk (a decode token) neither.
    assert build_forward_batch([rows[1]], PAGE).embeddings is None
    assert (
        build_forward_batch([SequenceInput([3], 8, [0, 1, 2], embeddings=[a])], PAGE).embeddings
        is None
    )


def test_embedding_of_vocabulary_rows_equals_the_plain_prompt(tiny):
    """A container holding the model's own embedding rows of some tokens must give exactly the
    output of the prompt with those tokens: the substitution is the only difference."""
    tok = tiny.tokenizer
    inner = tok.encode(" the quick red fox")[0].tolist()
    rows = tiny.model.network.embed[inner].clone()
    image = MMEmbedding(rows)
    ids = _encode(tiny, f"look at{image.text_alias} now", [image])
    plain = tok.encode("look at")[0].tolist() + inner + tok.encode(" now")[0].tolist()
    # fresh caches, several prefill chunks each: the same batch shapes, so the same floats
    got_logits, got_tokens, _ = _first_logits(
        tiny.generator(PAGE * 64, PAGE, max_chunk_size=8), ids, [image]
    )
    ref_logits, ref_tokens, _ = _first_logits(
        tiny.generator(PAGE * 64, PAGE, max_chunk_size=8), plain
    )
    assert torch.equal(got_logits, ref_logits)
    assert got_tokens == ref_tokens


def test_output_depends_on_the_embedding_content_only(tiny):
    text = "describe {} in words"
    a, b = MMEmbedding(_rows(tiny, 6, 0)), MMEmbedding(_rows(tiny, 6, 1))
    twin = MMEmbedding(a.embeddings.clone())  # same content, other placeholder ids

    def logits(container):
        generator = tiny.generator(page_size=PAGE)  # fresh cache: no prefix hits
        return _first_logits(
            generator, _encode(tiny, text.format(container.text_alias), [container]), [container]
        )

    la, lb, lt = logits(a), logits(b), logits(twin)
    assert not torch.allclose(la[0], lb[0], atol=1e-3)
    assert torch.equal(la[0], lt[0]) and la[1] == lt[1]


def test_jobs_with_and_without_embeddings_share_a_batch(tiny):
    tok = tiny.tokenizer
    a, b = MMEmbedding(_rows(tiny, 5, 0)), MMEmbedding(_rows(tiny, 3, 1))
    prompts = [
        (_encode(tiny, f"one {a.text_alias} two", [a]), [a]),
        (tok.encode("a plain prompt here")[0].tolist(), []),
        (_encode(tiny, f"{b.text_alias} three {a.text_alias}", [a, b]), [a, b]),
    ]
    alone = [_run(tiny.generator(page_size=PAGE), [_job(ids, e)])[0] for ids, e in prompts]
    together = _run(
        tiny.generator(page_size=PAGE, max_chunk_size=6), [_job(i, e) for i, e in prompts]
    )
    assert [r["job"].new_token_ids for r in together] == [r["job"].new_token_ids for r in alone]


# -- prefix caching ------------------------------------------------------------------------


def test_prefix_cache_keys_on_embedding_identity(tiny):
    """Same text, different rows: no shared page past the text before the container; the same
    rows in another container (other ids): the whole prompt's full pages are shared."""
    text = "ab{}and some words after it"
    a, b = MMEmbedding(_rows(tiny, 7, 0)), MMEmbedding(_rows(tiny, 7, 1))
    twin = MMEmbedding(a.embeddings.clone())
    generator = tiny.generator(page_size=PAGE)
    ids = {e: _encode(tiny, text.format(e.text_alias), [e]) for e in (a, b, twin)}
    before = len(tiny.tokenizer.encode("ab")[0].tolist())
    assert before < PAGE  # the container starts inside the first page
    (first,) = _run(generator, [_job(ids[a], [a])])
    assert first["cached_tokens"] == 0
    (other,) = _run(generator, [_job(ids[b], [b])])
    assert other["cached_tokens"] == 0
    (same,) = _run(generator, [_job(ids[twin], [twin])])
    full_pages = (len(ids[twin]) - 1) // PAGE
    assert full_pages >= 3 and same["cached_tokens"] == full_pages * PAGE
    assert same["job"].new_token_ids == first["job"].new_token_ids


def test_router_hashes_match_the_engine_pages(tiny):
    """The ingress/router hash function (prefix_hashes) with the containers gives the keys the
    engine registered, whatever the placeholder ids; without them it matches nothing."""
    a, b = MMEmbedding(_rows(tiny, 6, 0)), MMEmbedding(_rows(tiny, 6, 1))
    twin = MMEmbedding(a.embeddings.clone())
    text = "x{}y and more text to fill pages"
    generator = tiny.generator(page_size=PAGE)
    ids_a = _encode(tiny, text.format(a.text_alias), [a])
    _run(generator, [_job(ids_a, [a])])
    ids_twin = _encode(tiny, text.format(twin.text_alias), [twin])
    ids_b = _encode(tiny, text.format(b.text_alias), [b])
    full = len(ids_a) // PAGE
    router_twin = prefix_hashes(ids_twin, PAGE, embeddings=[twin])
    assert router_twin == prefix_hashes(ids_a, PAGE, embeddings=[a])
    assert prefix_hashes(ids_b, PAGE, embeddings=[b])[0] != router_twin[0]
    table = generator.cache.page_table
    assert len(table.match_prefix(router_twin)) == full  # prompt + generated pages cached
    assert table.match_prefix(prefix_hashes(ids_b, PAGE, embeddings=[b])) == []
    # the raw placeholder ids (a router ignoring embeddings) never match an embedding page
    assert table.match_prefix(prefix_hashes(ids_a, PAGE)) == []
    # pages without placeholders hash as before
    plain = tiny.tokenizer.encode("no images in here at all")[0].tolist()
    assert prefix_hashes(plain, PAGE, embeddings=[a]) == prefix_hashes(plain, PAGE)


def test_decode_graphs_leave_placeholder_tokens_to_the_eager_forward(small, monkeypatch):  # noqa: F811
    """After a prefix hit, a prompt's last token is a 1-token row like a decode token; when it
    is a placeholder, the graphs (which only embed vocabulary ids) must not take it."""
    from engine import Model

    monkeypatch.setenv(OPS_ENV, "cuda")
    model = Model.from_pretrained(small)
    graphs = DecodeGraphs(model, model.allocate_kv(8, PAGE), PAGE, 2, 16, capture=False)
    image = MMEmbedding(torch.zeros(2, model.config.hidden_size, dtype=model.dtype))
    last = image.placeholder_ids[-1]
    assert graphs.supports([SequenceInput([5], 4, [0, 1], embeddings=[image])])
    assert not graphs.supports([SequenceInput([last], 4, [0, 1], embeddings=[image])])


def test_preempted_jobs_with_embeddings_resume_to_the_same_output(tiny):
    """A tiny cache preempts; resumed jobs re-prefill (or hit their own cached pages, keyed by
    identity) and end with the tokens of an unconstrained run."""
    words = ["red", "fox", "over", "the", "slow", "river", "stone", "light"]
    prompts = []
    for i in range(6):
        image = MMEmbedding(_rows(tiny, 3 + i % 3, i % 4))  # some contents repeat
        text = f"{' '.join(words[i:])} {image.text_alias} {' '.join(words[: i + 2])}"
        prompts.append((_encode(tiny, text, [image]), [image]))

    def jobs():
        return [
            DynamicJob(i, 12, stop_conditions=[], gen_settings=GREEDY, embeddings=e)
            for i, e in prompts
        ]

    large = _run(tiny.generator(page_size=PAGE), jobs())
    small_gen = tiny.generator(max_num_tokens=18 * PAGE, page_size=PAGE, max_chunk_size=16)
    constrained = _run(small_gen, jobs())
    assert small_gen.stats()["preemptions"] > 0
    assert [r["job"].new_token_ids for r in constrained] == [r["job"].new_token_ids for r in large]


def test_a_request_carries_embeddings_to_the_job_and_the_router_hashes(tiny):
    """GenerationRequest (what the ingress sends a replica) with containers: after a pickle
    round trip (Ray's transport) the job runs as the library job, and the request's page
    hashes are the keys the engine registers."""
    import pickle

    from engine import GenerationRequest

    image = MMEmbedding(_rows(tiny, 6, 3))
    ids = _encode(tiny, f"see {image.text_alias} and say", [image])
    hashes = prefix_hashes(ids, PAGE, embeddings=[image])
    request = GenerationRequest(
        tuple(ids), 6, settings=GREEDY, stop_on_eos=False, page_hashes=hashes, embeddings=[image]
    )
    shipped = pickle.loads(pickle.dumps(request))
    assert shipped.embeddings[0].identity == image.identity
    generator = tiny.generator(page_size=PAGE)
    (served,) = _run(generator, [DynamicJob.from_request(shipped)])
    (library,) = _run(tiny.generator(page_size=PAGE), [_job(ids, [image])])
    assert served["job"].new_token_ids == library["job"].new_token_ids
    assert len(generator.cache.page_table.match_prefix(list(shipped.page_hashes))) == len(hashes)
    with pytest.raises(ValueError, match="not an embedding container"):
        GenerationRequest((1, 2), 4, embeddings=[torch.zeros(2, 2)])
