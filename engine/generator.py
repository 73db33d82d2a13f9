"""DynamicGenerator: continuous batching over a paged, prefix-caching KV cache.

    generator.enqueue(job)           # validate, then queue
    while generator.num_remaining_jobs():
        for result in generator.iterate():   # one forward over a ragged batch per call
            ...

Each ``iterate()`` asks the scheduler for a plan (decode tokens + prefill chunks under a token
budget), has the model runner run ONE forward for it, samples every row that reached the end
of its tokens on the device, and turns the tokens into per-job results (see DESIGN.md section
5 for the keys).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch

from engine.cache.kv_cache import PagedCache, recent_pages_for
from engine.cache.page_table import RECENT_BLOCKS
from engine.cfg import merge_cfg_rows
from engine.device_copy import upload
from engine.embeddings import check_prompt
from engine.inflight import PENDING_TOKEN, InFlightTokens
from engine.job import DynamicJob
from engine.model.runner import ModelRunner
from engine.sampling import BANNED_ROW, SampleOutput, SamplerSettings, sample
from engine.sampling_fast import SamplerState
from engine.scheduler import Scheduler, SchedulerConfig, StepPlan
from engine.speculative import setup as spec_setup
from engine.speculative.speculator import Speculator, split_logits

logger = logging.getLogger(__name__)

MAX_DERIVED_BATCH_SIZE = 256


class DynamicGenerator:
    def __init__(
        self,
        model,
        cache: PagedCache,
        tokenizer,
        max_batch_size: int | None = None,
        max_seq_len: int | None = None,
        max_chunk_size: int = 2048,
        max_q_size: int | None = None,
        max_skips: int = 4,
        cuda_graphs: bool | None = None,
        draft_model=None,
        draft_cache: PagedCache | None = None,
        num_draft_tokens: int = 4,
        use_ngram_draft: bool = False,
        max_ngram: int = 4,
        max_sampling_threads: int = 16,
        min_sampling_threads: int = 3,
        paged: bool = True,
        filter_background_eval: bool = True,
        defer_text: bool | None = None,
        async_scheduling: bool | None = None,
    ):
        """``max_skips``: the default for jobs that set none (``DynamicJob.max_skips``).
        ``cuda_graphs``: decode steps through CUDA graphs (see ``ModelRunner``); None: on a GPU
        with the kernels unless ``ENGINE_CUDA_GRAPHS=0``.

        Speculative decoding (engine/speculative/): ``draft_model`` + ``draft_cache`` (a
        PagedCache of the draft with the cache's page size and page count), or
        ``use_ngram_draft`` with suffixes up to ``max_ngram``; up to ``num_draft_tokens``
        drafts per job and step (adaptive, see engine/speculative/policy.py), which must be
        < ``max_q_size`` (default: 1 + num_draft_tokens when speculating, else 1).

        Seed parameters with no counterpart here: ``max_sampling_threads`` and
        ``min_sampling_threads`` (sampling is one batched tensor op on the device, not a thread
        pool: only the seed's defaults are accepted), ``paged`` (always paged: False is
        refused). ``filter_background_eval``: compute the filters' allowed-token masks on a
        host thread while the forward runs (False: after it, before sampling).

        ``defer_text``: make a step's text (detokenizing, stop strings) while the NEXT step's
        forward runs, so the host work of the text is off the path between two forwards; each
        token's result then comes one ``iterate()`` later (see ``_render_pending``). None: on
        when the model runs on a GPU (where the forward is asynchronous) and there is no
        speculation; jobs with banned strings, filters or token healing always make their
        text at once.

        ``async_scheduling``: a step's sampled tokens stay on the device and become the next
        step's input ids there; the host reads them after launching that next forward, so its
        work for both steps overlaps the device's (engine/inflight.py). Steps whose jobs need
        their token on the host before the next forward (filters, token healing, banned
        strings, returned probabilities, logits or logprobs) sample the usual way. Results
        then come one ``iterate()`` after their token was sampled. None: on when the model
        runs on a GPU and there is no speculation."""
        if cache.model is not model:
            raise ValueError("the cache was built for a different model")
        _check_seed_options(max_sampling_threads, min_sampling_threads, paged)
        speculating = spec_setup.check_speculation(
            draft_model, draft_cache, use_ngram_draft, num_draft_tokens, max_ngram
        )
        max_q_size = spec_setup.resolve_max_q_size(max_q_size, num_draft_tokens, speculating)
        self.num_draft_tokens = num_draft_tokens if speculating else 0  # as the seed
        self.model = model
        self.cache = cache
        self.tokenizer = tokenizer
        if max_batch_size is None:
            max_batch_size = max(1, min(MAX_DERIVED_BATCH_SIZE, cache.num_pages // 2))
        self.max_seq_len = _resolve_max_seq_len(max_seq_len, model, cache)
        if 0 < cache.sink_pages < max_batch_size:
            logger.warning(
                "%d sink pages for max_batch_size %d: at most %d sequences with distinct "
                "first pages run at once",
                cache.sink_pages,
                max_batch_size,
                cache.sink_pages,
            )
        if 0 < cache.recent_pages < recent_pages_for(max_batch_size):
            logger.warning(
                "%d recent pages for max_batch_size %d: at most %d sequences run at once "
                "(%d pages serve every one)",
                cache.recent_pages,
                max_batch_size,
                cache.recent_pages // RECENT_BLOCKS,
                recent_pages_for(max_batch_size),
            )
        config = SchedulerConfig(max_batch_size, max_chunk_size, max_q_size, max_skips)
        self.scheduler = Scheduler(config, cache.page_table)
        self.default_stop_tokens = frozenset(tokenizer.eos_token_ids) | frozenset(
            model.config.eos_token_ids
        )
        self._next_serial = 0
        self._jobs: dict[int, DynamicJob] = {}  # serial -> active job (waiting or running)
        self._undelivered: list[dict[str, Any]] = []  # results produced outside iterate()
        self._prompt_tokens_total = 0
        self._cached_tokens_total = 0
        if not isinstance(filter_background_eval, bool):
            raise ValueError(
                f"filter_background_eval must be a bool, got {filter_background_eval!r}"
            )
        self.filter_background_eval = filter_background_eval
        self.defer_text = _resolve_overlap("defer_text", defer_text, model, speculating)
        self.async_scheduling = _resolve_overlap(
            "async_scheduling", async_scheduling, model, speculating
        )
        self._in_flight: InFlightTokens | None = None  # the last step's tokens, still unread
        self.async_steps = 0  # steps whose tokens were read one step later (stats, tests)
        # (job, token, result data) taken in the last step, their text not made yet
        self._text_pending: list[tuple[DynamicJob, int, dict[str, Any]]] = []
        self._tokens_done: set[int] = set()  # serials of deferred jobs already out of the batch
        self._masks = None  # engine.constraints.masks.MaskEngine, built for the first filter
        self._masks_lock = threading.Lock()
        self._sampler = SamplerState()  # per-row parameters and per-job contexts across steps
        self.runner = ModelRunner(
            model,
            cache.kv,
            cache.page_size,
            max_batch_size=max_batch_size,
            max_seq_len=self.max_seq_len,
            cuda_graphs=cuda_graphs,
        )
        self.speculator: Speculator | None = None
        self.draft_cache = draft_cache  # (shares the page ids: it moves the same pages)
        if speculating:
            self.speculator = spec_setup.build_speculator(
                self,
                draft_model,
                draft_cache,
                num_draft_tokens,
                use_ngram_draft,
                max_ngram,
                cuda_graphs,
            )

    @property
    def max_batch_size(self) -> int:
        return self.scheduler.config.max_batch_size

    @property
    def max_chunk_size(self) -> int:
        return self.scheduler.config.max_chunk_size

    # -- job API ---------------------------------------------------------------------------

    def enqueue(self, job: DynamicJob) -> int:
        """Validate and queue a job; returns its serial number."""
        self.check_job(job)
        serial = self._next_serial
        masks = self.mask_engine() if job.needs_masks else None
        job.bind(serial, self.tokenizer, self.default_stop_tokens, masks=masks)
        self._next_serial += 1
        self._jobs[serial] = job
        self.scheduler.add(job.seq)
        return serial

    def check_job(self, job: DynamicJob) -> None:
        """Raise ValueError if ``job`` can never run here (read-only; safe from any thread)."""
        if not isinstance(job, DynamicJob):
            raise ValueError(f"enqueue takes a DynamicJob, got {type(job).__name__}")
        rows = [job.input_ids] + ([job.cfg_input_ids] if job.cfg_input_ids else [])
        if len(rows) > self.max_batch_size:  # the pair is admitted together or never
            raise ValueError(
                f"a CFG job runs two sequences at once; this generator's max_batch_size is "
                f"{self.max_batch_size}"
            )
        for ids in rows:  # a CFG job: both prompts
            total = len(ids) + job.max_new_tokens
            if total > self.max_seq_len:
                raise ValueError(
                    f"prompt ({len(ids)} tokens) + max_new_tokens ({job.max_new_tokens}) = "
                    f"{total} exceeds max_seq_len {self.max_seq_len}"
                )
        # A job must fit the cache alone (a single row does by max_seq_len), or it would
        # preempt itself forever.
        pages = sum(-(-(len(ids) + job.max_new_tokens) // self.cache.page_size) for ids in rows)
        room = self.cache.pages_for_rows(len(rows))
        if pages > room:
            raise ValueError(
                f"the CFG job's two rows need {pages} pages with max_new_tokens; the cache "
                f"has {room} for two rows"
            )
        if 0 < self.cache.sink_pages < len(rows):
            raise ValueError(
                f"the CFG job's {len(rows)} rows need a sink page each; the cache has "
                f"{self.cache.sink_pages}"
            )
        if self.scheduler.max_running < len(rows):
            raise ValueError(
                f"the CFG job's {len(rows)} rows run at once; the cache's "
                f"{self.cache.recent_pages} recent pages let {self.scheduler.max_running} run"
            )
        vocab = self.model.config.vocab_size
        hidden = self.model.config.hidden_size
        every_id = [t for ids in rows for t in ids]
        check_prompt(every_id, job.embeddings, vocab, hidden, self.model.dtype)
        if job.embeddings and self.speculator is not None and self.speculator.draft is not None:
            # the draft model prefills every prompt too and has no rows for the placeholders
            raise ValueError("jobs with embeddings cannot run on a generator with a draft model")
        _check_settings(job.gen_settings, vocab)
        if job.filters:
            self.mask_engine().validate(job.filters)
        if job.serial is not None:
            raise ValueError(f"job {job.identifier!r} was already enqueued (serial {job.serial})")

    def mask_engine(self):
        """The llguidance tokenizer, executor and mask thread (``MaskEngine``), built when the
        first job with filters or token healing arrives (thread-safe: ``check_job`` may run on
        any thread)."""
        with self._masks_lock:
            if self._masks is None:
                from engine.constraints.masks import MaskEngine

                self._masks = MaskEngine(
                    self.tokenizer.to_json(),
                    max(self.model.config.vocab_size, self.tokenizer.vocab_size),
                    sorted(self.default_stop_tokens),
                    background=self.filter_background_eval,
                    device=self.model.device,
                )
            return self._masks

    def num_remaining_jobs(self) -> int:
        """Jobs not finished yet, plus finished ones whose last result is still undelivered."""
        return len(self._jobs) + sum(1 for r in self._undelivered if r["eos"])

    def cancel(self, job: DynamicJob, emit_result: bool = True) -> bool:
        """Stop a job now and free its pages; its final result (eos_reason "cancelled") comes
        from the next ``iterate()``. False if the job was not active."""
        if self._jobs.get(job.serial) is not job:
            return False
        if emit_result and self._in_flight is not None and self._in_flight.holds(job):
            self._undelivered += self._read_in_flight()  # its last token first, as below
            if job.finished:
                return True
        if emit_result:  # its last token's text first; that may end the job (a stop string)
            self._undelivered += self._render_pending(only=job)
            if job.finished:
                return True
        else:
            self._text_pending = [p for p in self._text_pending if p[0] is not job]
        self._retire(job)
        if emit_result:
            self._undelivered.append(job.cancel_result())
        return True

    def take_undelivered(self) -> list[dict[str, Any]]:
        """Results produced outside ``iterate()`` (cancellations), handed over once."""
        results, self._undelivered = self._undelivered, []
        return results

    def iterate(self) -> list[dict[str, Any]]:
        """One scheduling step and one forward; returns the results it produced."""
        return self.take_undelivered() + self._step()

    def _step(self) -> list[dict[str, Any]]:
        if not self._jobs:
            return []
        if self.speculator is not None:
            self.speculator.before_schedule(self.scheduler.running)
        plan = self.scheduler.schedule()
        self._move_pages()
        results = [self._start(seq.owner) for seq in plan.admitted]
        if not plan.entries:
            return results + self._read_in_flight() + self._render_pending()
        qs = self.speculator.fill(plan) if self.speculator is not None else {}
        masks = self._launch_masks(plan)  # on a host thread while the forward runs
        patch = self._in_flight.input_patch(plan.entries) if self._in_flight else None
        try:
            logits = self.runner.forward_plan(plan, patch)
        except Exception as error:  # the forward failed: its jobs end, the generator goes on
            logger.exception("forward failed; ending the %d jobs of this step", len(plan.entries))
            results += self._read_in_flight() + self._render_pending()
            owners = dict.fromkeys(e.seq.owner for e in plan.entries)
            return results + [self._fail(job, error) for job in owners if not job.finished]
        # the previous step's tokens, read while the device runs this step's forward (before
        # the commit: pages it fills are hashed over their values)
        results += self._read_in_flight()
        # jobs without a token yet (a CFG job's two rows: one job); only they can have rows
        # scoring their prompt, which leave the logits even when the job ended meanwhile
        starting = list(
            dict.fromkeys(e.seq.owner for e in plan.entries if not e.seq.owner.new_token_ids)
        )
        logits, broken = self._take_prompt_logits(plan, logits, starting)
        prefilling = [job for job in starting if not job.finished]
        self.scheduler.commit(plan)
        results += [self._fail(job, error) for job, error in broken]
        results += [job.prefill_result() for job in prefilling if not job.finished]
        # the previous step's text, made while the device runs this step's forward
        results += self._render_pending()
        if any(e.drafts for e in plan.entries):
            return results + self._sample_speculative(plan, logits, qs, masks)
        results += self._sample(plan, logits, masks)
        return results

    def _take_prompt_logits(
        self, plan: StepPlan, logits: torch.Tensor, starting: list[DynamicJob]
    ) -> tuple[torch.Tensor, list[tuple[DynamicJob, Exception]]]:
        """Hand the rows that score prompt tokens (``StepEntry.prompt_rows``) to their jobs;
        returns the sampled rows alone, as a plan without prompt rows would have them, and
        the jobs that failed there with their errors (the caller ends them after the
        commit; their sampled rows are dropped as finished jobs' are). Only ``starting`` jobs
        (no token yet) can have such rows: a decode step looks at none."""
        if not any(job.seq.prompt_logits for job in starting):
            return logits, []
        kept: list[int] = []
        broken = []
        row = 0
        for e in plan.entries:
            count = e.prompt_rows
            if count:
                job = e.seq.owner
                try:
                    job.receive_prompt_logits(
                        e.start, logits[row : row + count], self.tokenizer.vocab_size
                    )
                except Exception as error:
                    logger.exception("prompt logprobs failed; ending job %r", job.identifier)
                    broken.append((job, error))
            kept.extend(range(row + count, row + count + e.logits_rows))
            row += count + e.logits_rows
        index = torch.tensor(kept, dtype=torch.long, device=logits.device)
        return logits[index], broken

    def _move_pages(self) -> None:
        """The page copies the schedule planned (recent pages settling), in every cache on
        the scheduler's page ids, before any forward (the draft's included) touches them."""
        moves = self.scheduler.take_page_moves()
        if moves:
            self.cache.move_pages(moves)
            if self.draft_cache is not None:
                self.draft_cache.move_pages(moves)

    def _launch_masks(self, plan: StepPlan):
        if self._masks is None:
            return None
        # one mask per job sampled the plain way: a CFG job's negative row is merged away
        # before sampling, and rows with drafts are verified without masks
        sampled = [e for e in plan.entries if e.samples and not e.drafts and not e.seq.is_partner]
        return self._masks.launch([e.seq.owner.mask_source() for e in sampled])

    def _start(self, job: DynamicJob) -> dict[str, Any]:
        job.mark_started()
        self._prompt_tokens_total += job.prompt_tokens
        self._cached_tokens_total += job.seq.cached_tokens
        return job.started_result()

    def _sample(self, plan: StepPlan, logits: torch.Tensor, masks=None) -> list[dict[str, Any]]:
        entries = [e for e in plan.entries if e.samples]
        if not entries:
            return []
        jobs, logits = merge_cfg_rows(entries, logits)  # a CFG job's two rows -> one
        try:
            token_mask = None if masks is None else masks.result()
        except Exception as error:  # the grammar engine failed: its rows' jobs end
            logger.exception("filter masks failed; ending the constrained jobs of this step")
            failed = [self._fail(j, error) for j in jobs if j.mask_source() is not None]
            # the others sample unmasked (_fail finished the constrained ones; jobs a late stop
            # string ended drop out too)
            jobs, logits, _ = _without_finished(jobs, logits, None)
            if not jobs:
                return failed
            return failed + self._sample_rows(jobs, logits, None)
        jobs, logits, token_mask = _without_finished(jobs, logits, token_mask)
        if not jobs:
            return []
        if self.async_scheduling and token_mask is None and all(j.reads_late for j in jobs):
            return self._sample_in_flight(jobs, logits)
        return self._sample_rows(jobs, logits, token_mask)

    def _sample_in_flight(self, jobs: list[DynamicJob], logits: torch.Tensor) -> list[dict]:
        """Sample without waiting for the tokens: they go to the host while the next step is
        planned and launched (``_read_in_flight``). Each job's sequences hold PENDING_TOKEN
        meanwhile; a job whose tokens are complete by count leaves the batch now."""
        try:
            requests = [job.sample_request() for job in jobs]
            sampled = self._sampler.sample_on_device(logits, requests, self.tokenizer.vocab_size)
        except Exception:  # one row's data or settings: the usual path finds it
            logger.warning("device sampling failed; sampling on the host", exc_info=True)
            return self._sample_rows(jobs, logits, None)
        pending = []
        for job in jobs:
            if len(job.new_token_ids) + 1 >= job.max_new_tokens:  # its last token
                self.scheduler.remove(job.seq)
                self._tokens_done.add(job.serial)
                pending.append(False)
                continue
            job.seq.tokens.append(PENDING_TOKEN)
            if job.seq.partner is not None:  # a CFG job's negative row: the same token
                job.seq.partner.tokens.append(PENDING_TOKEN)
            pending.append(True)
        self._in_flight = InFlightTokens.launch(
            jobs, requests, sampled.tokens, sampled.flags, logits, pending
        )
        self.async_steps += 1
        return []

    def _read_in_flight(self) -> list[dict[str, Any]]:
        """The results of the last step's in-flight tokens (waits for their copy only)."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return []
        tokens, flags = flight.read()
        token_tensors = _token_tensors(tokens)
        results = []
        for i, job in enumerate(flight.jobs):
            if self._jobs.get(job.serial) is not job:  # failed or cancelled meanwhile
                continue
            token = tokens[i]
            try:
                token_tensors_i = token_tensors[i]
                if flags[i]:  # no finite maximum: the reference's answer
                    token = self._resample(flight, i, token)
                    token_tensors_i = None
                if token == BANNED_ROW:  # the host sampler found no token for this row
                    raise ValueError(f"every token is banned for job {job.identifier!r}")
                data = job.take_token(
                    token, token_tensor=token_tensors_i, replaces_pending=flight.pending[i]
                )
            except Exception as error:
                results.append(self._fail(job, error))
                continue
            results.append(self._rendered(job, token, data))
        return results

    def _resample(self, flight: InFlightTokens, row: int, fed: int) -> int:
        """A flagged row's token from the reference sampler, with the context it had
        (``BANNED_ROW`` when it finds none). The device's pick ``fed`` is already the running
        step's input: a job whose reference token differs ends here."""
        request = flight.requests[row]
        if flight.pending[row] and request.context:  # drop the PENDING_TOKEN it holds now
            request = dataclasses.replace(request, context=request.context[:-1])
        logits = flight.logits[row : row + 1]
        token = sample(logits, [request], self.tokenizer.vocab_size).tokens[0]
        job = flight.jobs[row]
        if token not in (fed, BANNED_ROW):  # a NaN row the device path picked differently
            raise ValueError(
                f"job {job.identifier!r}: its logits hold a NaN or no finite value, and the "
                "token the device already fed to the next step is not the reference sampler's"
            )
        return token

    def _sample_rows(self, jobs, logits, token_mask) -> list[dict[str, Any]]:
        try:
            requests = [job.sample_request() for job in jobs]
            out = self._sampler.sample(logits, requests, self.tokenizer.vocab_size, token_mask)
        except Exception:  # one row's data or settings: find it, sample the others alone
            logger.warning("batched sampling failed; sampling row by row", exc_info=True)
            return self._sample_row_by_row(jobs, logits, token_mask)
        return self._receive(jobs, logits, out)

    def _sample_speculative(self, plan: StepPlan, logits: torch.Tensor, qs, masks) -> list[dict]:
        """Entries without drafts sample as usual; the others go through the rejection
        sampler and receive several tokens at once (a failure there ends its jobs alone)."""
        plain, plain_logits, spec, spec_logits = split_logits(plan, logits)
        results = self._sample(StepPlan(entries=plain), plain_logits, masks) if plain else []
        try:
            verified = self.speculator.verify(spec, spec_logits, qs)
        except Exception as error:
            logger.exception("draft verification failed; ending the %d jobs", len(spec))
            return results + [self._fail(e.seq.owner, error) for e in spec]
        for entry, outcome in zip(spec, verified, strict=True):
            results.append(self._receive_verified(entry.seq.owner, outcome))
        return results

    def _receive_verified(self, job: DynamicJob, outcome) -> dict[str, Any]:
        self.speculator.record(job, outcome)
        before = len(job.new_token_ids)
        try:
            result = job.receive_tokens(outcome.tokens)
        except Exception as error:
            return self._fail(job, error)
        # accepted drafts the job took have their K/V: count them computed (and cache their
        # full pages) before a finished job gives its pages back
        self.scheduler.advance(job.seq, min(outcome.accepted, len(job.new_token_ids) - before))
        if result["eos"]:
            self._retire(job)
        return result

    def _sample_row_by_row(
        self, jobs: list[DynamicJob], logits: torch.Tensor, token_mask: torch.Tensor | None
    ) -> list[dict]:
        """The slow path after a failed batch: each job alone, so a failure ends only its job.
        (Rows that had drawn their random number in the failed batch draw again.)"""
        results = []
        for i, job in enumerate(jobs):
            row = logits[i : i + 1]
            mask = None if token_mask is None else token_mask[i : i + 1]
            try:
                out = sample(row, [job.sample_request()], self.tokenizer.vocab_size, mask)
            except Exception as error:
                results.append(self._fail(job, error))
                continue
            results += self._receive([job], row, out)
        return results

    def _receive(
        self, jobs: list[DynamicJob], logits: torch.Tensor, out: SampleOutput
    ) -> list[dict[str, Any]]:
        """Hand each job its token; a job that fails on it (detokenizer, stop strings) ends
        alone."""
        token_tensors = _token_tensors(out.tokens)
        results = []
        for i, job in enumerate(jobs):
            if out.tokens[i] == BANNED_ROW:  # nothing could be sampled: this job only ends
                message = f"every token is banned for job {job.identifier!r} at this step"
                results.append(self._fail(job, ValueError(message)))
                continue
            try:
                data = job.take_token(
                    out.tokens[i],
                    token_tensor=token_tensors[i],
                    prob=out.probs[i] if job.return_probs else None,
                    top_tokens=out.top_tokens[i] if job.return_top_tokens else None,
                    top_probs=out.top_probs[i] if job.return_top_tokens else None,
                    logits=logits[i].cpu() if job.return_logits else None,
                    logprobs=_logprobs_of(out, i) if job.return_logprobs is not None else None,
                )
                if self.defer_text and job.defers_text:
                    self._defer(job, out.tokens[i], data)
                    continue
                result = job.render_token(out.tokens[i], data)
            except Exception as error:
                results.append(self._fail(job, error))
                continue
            if job.rewind_to is not None:  # a banned-string rollback: take the tokens back
                self.scheduler.truncate(job.seq, job.rewind_to)
                job.rewind_to = None
            if result["eos"]:
                self._retire(job)
            results.append(result)
        return results

    def _defer(self, job: DynamicJob, token: int, data: dict[str, Any]) -> None:
        """Keep a taken token for the next step's ``_render_pending``; a job whose tokens are
        complete leaves the batch now (its pages go back), its final result comes then."""
        self._text_pending.append((job, token, data))
        if job.tokens_complete:
            self.scheduler.remove(job.seq)
            self._tokens_done.add(job.serial)

    def _render_pending(self, only: DynamicJob | None = None) -> list[dict[str, Any]]:
        """The results of deferred tokens (``defer_text``), in the order they were sampled.

        A stop string found here ends a job that the step now running may have scheduled
        again: it is retired (its pages go back) and the row it gets in this step is dropped
        before sampling (``_without_finished``), so nothing past the stop is taken."""
        if only is None:
            pending, self._text_pending = self._text_pending, []
        else:
            pending = [p for p in self._text_pending if p[0] is only]
            self._text_pending = [p for p in self._text_pending if p[0] is not only]
        return [
            self._rendered(job, token, data)
            for job, token, data in pending
            if self._jobs.get(job.serial) is job  # (not failed or cancelled meanwhile)
        ]

    def _rendered(self, job: DynamicJob, token: int, data: dict[str, Any]) -> dict[str, Any]:
        """``job.render_token``; a job that fails there ends alone, one that ends is retired."""
        try:
            result = job.render_token(token, data)
        except Exception as error:
            return self._fail(job, error)
        if result["eos"]:
            self._retire(job)
        return result

    def _fail(self, job: DynamicJob, error: Exception) -> dict[str, Any]:
        """End one job with an "error" result and free its pages."""
        logger.warning("job %r failed: %r", job.identifier, error)
        if self._jobs.get(job.serial) is job:
            self._retire(job)
        return job.error_result(error)

    def _retire(self, job: DynamicJob) -> None:
        if job.serial in self._tokens_done:  # a deferred job already out of the batch
            self._tokens_done.discard(job.serial)
        else:
            self.scheduler.remove(job.seq)
        del self._jobs[job.serial]
        if self.speculator is not None:
            self.speculator.forget(job)

    # -- convenience -----------------------------------------------------------------------

    def generate(
        self,
        prompt: str | list[str],
        max_new_tokens: int,
        min_new_tokens: int = 0,
        seed: int | None = None,
        gen_settings: SamplerSettings | Sequence[SamplerSettings] | None = None,
        stop_conditions: Sequence[int | str] | None = None,
        add_bos: bool = False,
        encode_special_tokens: bool = False,
        decode_special_tokens: bool = False,
        completion_only: bool = False,
        return_last_results: bool = False,
    ):
        """Run prompts to completion and return their text (a list for a list of prompts).

        Drives only its own jobs: results of jobs enqueued by others are kept and returned
        by the caller's next ``iterate()``.
        """
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        settings = _per_prompt_settings(gen_settings, len(prompts))
        jobs = []
        for i, text in enumerate(prompts):
            ids = self.tokenizer.encode(
                text, add_bos=add_bos, encode_special_tokens=encode_special_tokens
            )
            job = DynamicJob(
                ids,
                max_new_tokens,
                min_new_tokens=min_new_tokens,
                stop_conditions=stop_conditions,
                gen_settings=settings[i],
                seed=None if seed is None else seed + i,
                decode_special_tokens=decode_special_tokens,
            )
            self.enqueue(job)
            jobs.append(job)
        last = self._drive(jobs)
        texts = [
            job.full_completion if completion_only else prompts[i] + job.full_completion
            for i, job in enumerate(jobs)
        ]
        if isinstance(prompt, str):
            texts, last = texts[0], last[0]
        return (texts, last) if return_last_results else texts

    def _drive(self, jobs: list[DynamicJob]) -> list[dict[str, Any]]:
        mine = {id(job) for job in jobs}
        last: dict[int, dict[str, Any]] = {}
        while len(last) < len(jobs):
            for result in self._step():
                if id(result["job"]) in mine:
                    if result["eos"]:
                        last[id(result["job"])] = result
                else:
                    self._undelivered.append(result)
        return [last[id(job)] for job in jobs]

    def stats(self) -> dict[str, Any]:
        table = self.cache.page_table
        spec = self.speculator.stats() if self.speculator is not None else {}
        return spec | {
            "pages_total": table.num_pages,
            "pages_in_use": table.num_referenced,
            "pages_cached": table.num_cached,
            "pages_free": table.num_free,
            "sink_pages": table.num_sink_pages,  # (of pages_total: first blocks only)
            "sink_pages_available": table.num_sink_available,  # free or cached
            "recent_pages": table.num_recent_pages,  # (of pages_total: newest blocks)
            "recent_pages_free": table.num_recent_free,
            "page_size": table.page_size,
            "jobs_running": len(self.scheduler.running),
            "jobs_waiting": len(self.scheduler.waiting),
            "preemptions": self.scheduler.preemptions,
            "evictions": table.evictions,
            "cached_tokens_total": self._cached_tokens_total,
            "prompt_tokens_total": self._prompt_tokens_total,
            "decode_graph_steps": self.runner.decode_graph_steps,
            "async_steps": self.async_steps,
        }


def _resolve_overlap(name: str, value: bool | None, model, speculating: bool) -> bool:
    """``defer_text`` / ``async_scheduling``: None means on for a GPU without speculation
    (its forward is asynchronous: there is something to overlap). Neither combines with
    speculation: a step's accepted drafts are taken and rendered together, and the next
    drafts need them on the host."""
    if value is None:
        return model.device.type == "cuda" and not speculating
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool or None, got {value!r}")
    if value and speculating:
        raise ValueError(f"{name}=True cannot be combined with speculative decoding")
    return value


def _token_tensors(tokens: list[int]) -> tuple[torch.Tensor, ...]:
    """Each token as a (1, 1) long tensor (a result's ``token_ids``): one tensor for the step,
    viewed per token (a tensor per token costs ~10 us)."""
    return torch.tensor(tokens, dtype=torch.long).view(-1, 1, 1).unbind(0)


def _without_finished(jobs: list[DynamicJob], logits: torch.Tensor, token_mask):
    """Drop the rows of jobs that ended while their step ran (a stop string in the previous
    step's deferred text): their tokens are past the stop."""
    keep = [i for i, job in enumerate(jobs) if not job.finished]
    if len(keep) == len(jobs):
        return jobs, logits, token_mask
    index = upload(keep, logits.device, torch.long)
    mask = None if token_mask is None else token_mask[index.to(token_mask.device)]
    return [jobs[i] for i in keep], logits[index], mask


def _check_seed_options(max_sampling_threads, min_sampling_threads, paged) -> None:
    """The seed's threading and unpaged options: refused unless at their defaults."""
    if max_sampling_threads != 16 or min_sampling_threads != 3:
        raise ValueError(
            f"max_sampling_threads={max_sampling_threads!r}, min_sampling_threads="
            f"{min_sampling_threads!r}: sampling here is batched on the device, not threaded "
            "per job; leave them at the seed's defaults (16, 3)"
        )
    if paged is not True:
        raise ValueError(f"paged={paged!r}: this generator always uses the paged KV cache")


def _check_settings(settings: SamplerSettings, vocab: int) -> None:
    """Values a sampler step cannot take are refused at enqueue, not found mid-step."""
    if settings.top_k > vocab:
        raise ValueError(f"top_k={settings.top_k} exceeds the vocabulary size {vocab}")
    bad = [t for t in settings.token_bias if t >= vocab]
    if bad:
        raise ValueError(f"token_bias ids {bad[:5]} are outside the vocabulary (size {vocab})")


def _resolve_max_seq_len(max_seq_len: int | None, model, cache: PagedCache) -> int:
    room = cache.pages_for_rows(1) * cache.page_size  # (the cache, less other sink pages)
    limit = min(model.config.max_position_embeddings, room)
    if max_seq_len is None:
        return limit
    if not 1 <= max_seq_len <= room:
        raise ValueError(f"max_seq_len {max_seq_len} must be in [1, cache size {room}]")
    return max_seq_len


def _per_prompt_settings(gen_settings, count: int) -> list[SamplerSettings | None]:
    if gen_settings is None or isinstance(gen_settings, SamplerSettings):
        return [gen_settings] * count
    settings = list(gen_settings)
    if len(settings) != count:
        raise ValueError(f"{len(settings)} gen_settings for {count} prompts")
    return settings


def _logprobs_of(out: SampleOutput, row: int) -> tuple[float, list[int], list[float]]:
    return out.logprobs[row], out.top_logprob_ids[row], out.top_logprobs[row]
