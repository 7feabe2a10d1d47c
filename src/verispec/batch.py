"""Many requests decoded together: the batch loop beside `engine.decode`, reusing its phases.

Owns `BatchEngine`, which runs the decode loops of many requests (`Job`s) in steps. Each step:

1. admit waiting jobs, first come first served, while there are sequence slots and KV blocks
   for their prompts (a prompt that starts with cached blocks shares them: `kv_pool`);
2. every decoding job drafts as `engine.decode` does (`engine.next_draft`: its own drafter,
   controller and method); the drafts are then cut together for the step's best expected
   tokens per second (`control.allocate_drafts`: a draft row costs more when the forward is
   already wide), and the verify rows (chains or trees) join the step's forward;
3. waiting prompts are prefilled in chunks in the same forward, within a row budget
   (`max_rows`), so a long prompt never stalls the sequences already decoding;
4. one forward of the target runs all those rows (`batch_forward.forward_parts`): every row's
   logits are the bits its sequence gets alone;
5. each job accepts, rolls back and commits as `engine.decode` does (its rule, its own sampling
   generator, `engine.settle`), and stops on EOS or its token budget (`engine.apply_stops`).

So a request's output is the one it gives alone, whatever else runs: greedy outputs token for
token, and seeded sampled outputs of `ar` and the deterministic drafters too (one draw from the
job's own generator per committed token, whatever the draft lengths).

When KV memory runs out mid-run, the most recently admitted job is preempted: its blocks go back
(its full ones to the prefix cache) and it waits at the head of the queue; on its return its
context is recomputed (the same bits: the C layers are batch-invariant) and it goes on where it
stopped. A request that could never fit the pool is refused when submitted (`PoolExhausted`).

Exact batching needs a target whose sequences page their KV in its block pool
(`Target.pages_kv`: the fast path's C layers with int8 numerics). Methods that draft with a
model (`eesd`, `sps`, `mtad`: `Method.draws`) run unbatched beside the batch, one
`engine.decode` step per batch step on a sequence of their own. A target without paged KV
(float32 numerics, transformers' forward, a GPU) serves its jobs one at a time, in order.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .batch_forward import ALL, LAST, NONE, Part, prepare
from .control import RowCosts, allocate_drafts
from .drafters.base import EMPTY_DRAFT
from .engine import (DecodeConfig, Logprobs, Recipe, apply_stops, close_drafter, decode, next_draft, settle,
                     verify_tokens)
from .errors import ConfigError
from .runtime.kv_pool import PoolExhausted
from .runtime.rows import BLOCK
from .sequence import TargetSequence
from .stats import GenerationStats

log = logging.getLogger("verispec.batch")

WAITING, PREFILL, DECODE, DONE = "waiting", "prefill", "decode", "done"
DEFAULT_MAX_ROWS = 256  # rows of one step's forward (verify rows first, then prompt chunks)
DEFAULT_MAX_SEQUENCES = 64

_ids = itertools.count(1)


@dataclass(eq=False)
class Job:
    """One request in the batch: the per-sequence state (its tokens, its KV sequence, its
    method's drafter, controller and rule, its sampling generator, its stats)."""

    prompt: list[int]
    recipe: Recipe
    config: DecodeConfig
    stats: GenerationStats
    batched: bool = True  # its rows join the shared forward (else: its own engine.decode)
    id: int = field(default_factory=lambda: next(_ids))
    state: str = WAITING
    context: list[int] = field(default_factory=list)  # the prompt, then every committed token
    sequence: TargetSequence | None = None
    generator: torch.Generator | None = None
    first_token: bool = True  # its prefill ends with the first token (False: a preempted job's recompute)
    logprobs: Logprobs | None = None  # where the committed tokens' log-probabilities go, if wanted
    error: BaseException | None = None
    finish_reason: str = ""  # "eos", "length", "cancelled", "error"
    admitted_at: float = 0.0
    _steps: Iterator[list[int]] | None = None  # an unbatched job's decode loop

    @property
    def done(self) -> bool:
        return self.state == DONE

    @property
    def prefill_to(self) -> int:
        """Positions its cache must hold before it decodes: the prompt (its last token yields the
        first new one), or after a preemption every committed token but the last."""
        return len(self.context) if self.first_token else len(self.context) - 1


class BatchEngine:
    """Decode loops of many jobs in shared forwards (see the module docstring). Not thread-safe:
    one thread submits, steps and cancels (the server's worker)."""

    def __init__(self, target, max_rows: int = DEFAULT_MAX_ROWS, max_sequences: int = DEFAULT_MAX_SEQUENCES):
        if not isinstance(max_rows, int) or max_rows < 1:
            raise ConfigError(f"max_rows must be an integer >= 1, got {max_rows!r}")
        if not isinstance(max_sequences, int) or max_sequences < 1:
            raise ConfigError(f"max_sequences must be an integer >= 1, got {max_sequences!r}")
        self.target = target
        self.max_rows, self.max_sequences = max_rows, max_sequences
        self.batches = target.pages_kv
        if not self.batches:
            log.info("%s keeps no paged KV (float32 numerics, transformers' forward or a GPU): its requests run "
                     "one at a time", target.name)
        self.row_costs = RowCosts()  # a step's seconds by its rows, for cutting drafts under load
        self.waiting: collections.deque[Job] = collections.deque()
        self.running: list[Job] = []
        self.last_rows = 0  # rows of the last step's shared forward

    # -- jobs in and out -------------------------------------------------------------------------
    def submit(self, prompt: list[int], recipe: Recipe, config: DecodeConfig, stats: GenerationStats,
               draws: bool = False, sequence: TargetSequence | None = None) -> Job:
        """Queue a request (its prompt ids, a fresh recipe, its decode config and stats); `draws`:
        its method drafts with a model (runs unbatched); `sequence`: the target sequence its
        recipe was built on (a drafter that runs the target's layers drafts in it), else a new
        one. Refuses a prompt that is empty, too long for the model, or could never fit the KV
        pool."""
        if not prompt:
            raise ConfigError("the prompt is empty: at least one token is needed")
        if len(prompt) + config.max_new_tokens > self.target.max_length:
            raise ConfigError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({config.max_new_tokens}) exceeds the "
                              f"model's context of {self.target.max_length} tokens")
        if self.batches:
            # its longest cache: prompt + output, and a verify's scratch rows past it
            need = -(-(len(prompt) + config.max_new_tokens + 2 * BLOCK) // BLOCK)
            if need > self.target.pool.blocks:
                raise PoolExhausted(f"a request of {len(prompt)} prompt tokens and up to {config.max_new_tokens} new "
                                    f"ones needs {need} blocks of KV memory; the pool has {self.target.pool.blocks}")
        stats.prompt_tokens = len(prompt)
        job = Job(list(prompt), recipe, config, stats, batched=self.batches and not draws, context=list(prompt),
                  sequence=sequence or self.target.new_sequence())
        self.waiting.append(job)
        return job

    def cancel(self, job: Job, reason: str = "cancelled") -> None:
        """End `job` now (waiting or running): its blocks go back, its drafter is closed."""
        if job.done:
            return
        if job in self.waiting:
            self.waiting.remove(job)
        self._finish(job, reason)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    @property
    def jobs(self) -> int:
        return len(self.waiting) + len(self.running)

    def _finish(self, job: Job, reason: str, error: BaseException | None = None) -> None:
        if job in self.running:
            self.running.remove(job)
        job.state, job.finish_reason, job.error = DONE, reason, error
        job.stats.stop_reason = job.stats.stop_reason or reason
        if job._steps is not None:
            job._steps.close()  # an unbatched job's loop closes its drafter
        else:
            close_drafter(job.recipe.drafter)
        if job.sequence is not None:
            job.sequence.release()

    # -- one step ------------------------------------------------------------------------------
    def step(self) -> list[tuple[Job, list[int]]]:
        """Run one step of every running job (see the module docstring); returns the tokens each
        job committed in it, in job order, including jobs that ended (`Job.done`: then
        `finish_reason`, and `error` for one that failed; its last tokens may be empty)."""
        self.admit()
        events: list[tuple[Job, list[int]]] = []
        batched = [job for job in self.running if job.batched]
        if batched:
            events += self._shared_step(batched)
        for job in [job for job in self.running if not job.batched]:
            events.append((job, self._own_step(job)))
            if not self.batches:
                break  # a target without paged KV: one job at a time
        return events

    def admit(self) -> None:
        """Move waiting jobs to running, in order, while there is room (sequences, and free
        blocks for the prompt beyond what the prefix cache holds, with a block to spare per
        running job for its next verify). A job that cannot start with nothing else running
        never will (blocks held outside the engine): it ends with `PoolExhausted`."""
        while self.waiting and len(self.running) < self.max_sequences:
            job = self.waiting[0]
            if job.batched and self._twin_prefilling(job):
                return  # it starts from the twin's blocks once they are cached (n choices of one prompt)
            if job.batched:
                if not self._start_batched(job):
                    if not self.running:
                        self.waiting.popleft()
                        self._finish(job, "error", PoolExhausted(
                            f"KV memory exhausted: job {job.id} needs {job.prefill_to} positions, "
                            f"{self.target.pool.free_blocks} blocks of {BLOCK} are free"))
                        continue
                    return
            elif not self.batches and self.running:
                return  # one at a time
            self.waiting.popleft()
            job.admitted_at = time.perf_counter()
            job.state = PREFILL if job.batched else DECODE
            self.running.append(job)

    def _twin_prefilling(self, job: Job) -> bool:
        """Whether a running job is still prefilling the same prompt (its blocks will be shared)."""
        prompt = job.context[: job.prefill_to]
        return any(other.state == PREFILL and other.prefill_to == len(prompt) and other.context[: other.prefill_to] == prompt
                   for other in self.running if other.batched)

    def _start_batched(self, job: Job) -> bool:
        """Give `job` a paged sequence starting from the cached blocks of its context, if the
        pool can hold the rest of its prefill; False (nothing taken) if not. The first time, its
        drafter begins and its sampling generator is made (a preempted job keeps both)."""
        sequence = job.sequence
        sequence.reset()
        sequence.cache.start_from_cache(job.context[: job.prefill_to])
        need = -(-(job.prefill_to + 1) // BLOCK) - len(sequence.cache.blocks) + len(self.running)
        if need > self.target.pool.free_blocks:
            sequence.release()
            return False
        if job.generator is None:
            job.generator = job.config.sampling.generator(device=self.target.device)
            job.recipe.drafter.begin(job.context)
        return True

    def _own_step(self, job: Job) -> list[int]:
        """One `engine.decode` step of an unbatched job on its own sequence."""
        if job._steps is None:
            job._steps = decode(job.sequence, job.recipe, job.prompt, job.config, job.stats, job.logprobs)
        try:
            committed = next(job._steps)
        except StopIteration:
            committed = []
        except Exception as error:  # noqa: BLE001 - one job's failure must not end the others
            self._finish(job, "error", error)
            return []
        if job.stats.stop_reason:
            job._steps.close()
            self._finish(job, job.stats.stop_reason)
        return committed

    def _shared_step(self, jobs: list[Job]) -> list[tuple[Job, list[int]]]:
        """Draft, verify in one forward, accept: every batched running job, plus prompt chunks."""
        started = time.perf_counter()
        decoding = [job for job in jobs if job.state == DECODE]
        prefilling = any(job.state == PREFILL for job in jobs)
        # draft rows each decoding job may use: the budget shared, a quarter kept for prompt chunks
        budget = self.max_rows * 3 // 4 if prefilling else self.max_rows
        share = max(0, budget // max(1, len(decoding)) - 1)
        for job in decoding:  # blocks for the longest verify first: preempt while they are missing
            if job.state == DECODE:
                self._reserve(job, job.sequence.length + 2 * (self._room(job, share) + 1))
        drafted = []  # (job, its uncut draft, seconds spent drafting)
        for job in decoding:
            if job.state != DECODE:
                continue  # preempted
            drafted_at = time.perf_counter()
            drafter, controller, _ = job.recipe
            try:
                draft = next_draft(drafter, controller, job.context, self._room(job, share), True, cut=False)
            except Exception as error:  # noqa: BLE001 - a drafter's failure ends its job only
                self._finish(job, "error", error)
                continue
            drafted.append((job, draft, time.perf_counter() - drafted_at))
        lengths = self._cut_drafts(drafted, prefilling)
        parts, plans = [], []
        for (job, draft, draft_s), length in zip(drafted, lengths):
            draft = draft.prefix(length)
            tokens, parents = verify_tokens(job.context, draft)
            parts.append(Part(job.sequence, tokens, parents, ALL))
            plans.append((job, draft, draft_s))
        budget = self.max_rows - sum(len(part.tokens) for part in parts)
        for job in [job for job in self.running if job.batched and job.state == PREFILL]:
            chunk = min(job.prefill_to - job.sequence.length, budget)
            if chunk <= 0:
                break
            end = job.sequence.length + chunk
            part = Part(job.sequence, job.context[job.sequence.length : end],
                        logits=LAST if end == job.prefill_to and job.first_token else NONE)
            try:
                prepare(part)
            except PoolExhausted:
                break  # it waits for blocks (first come first served: no later prompt goes first)
            parts.append(part)
            plans.append((job, None, 0.0))
            budget -= chunk
        self.last_rows = sum(len(part.tokens) for part in parts)
        if not parts:
            return []
        forward_started = time.perf_counter()
        try:
            results = self.target.forward_parts(parts)
        except Exception as error:  # noqa: BLE001 - a failed forward ends the jobs in it, not the engine
            log.exception("a batched forward failed")
            for job, _, _ in plans:
                self._finish(job, "error", error)
            return [(job, []) for job, _, _ in plans]
        forward_s = time.perf_counter() - forward_started
        if all(draft is not None for _, draft, _ in plans):
            # decode steps only: a prompt chunk's rows fill the kernel's tiles and cost less each
            # than the draft rows this fit prices (with them, b came out at half a draft row's cost)
            self.row_costs.observe(self.last_rows, forward_s)
        events = []
        for (job, draft, draft_s), part, logits in zip(plans, parts, results):
            share_s = forward_s * len(part.tokens) / self.last_rows  # this job's part of the forward
            try:
                committed = self._settle(job, draft, part, logits, share_s, draft_s)
            except Exception as error:  # noqa: BLE001 - a rule's failure ends its job only
                self._finish(job, "error", error)
                events.append((job, []))
                continue
            if committed is not None:
                events.append((job, committed))
        elapsed = time.perf_counter() - started
        for job, draft, _ in plans:  # each decoding job spent the step's wall time on its step
            if draft is not None:
                job.stats.decode_s += elapsed
        return events

    def _cut_drafts(self, drafted: list, prefilling: bool) -> list[int]:
        """How much of each job's draft to verify: jointly, for the step's best expected tokens
        per second (`control.allocate_drafts` under the fitted `RowCosts`), from each draft's
        confidences, or where a drafter gives none from its job's acceptance so far. Drawn drafts
        (none here: their methods run unbatched) stay whole."""
        costs = self.row_costs.fit()
        if costs is None or not drafted:
            return [len(draft) for _, draft, _ in drafted]
        confidences = []
        for job, draft, _ in drafted:
            if draft.drawn or not len(draft):
                confidences.append(())
            elif draft.confidence:
                confidences.append(draft.confidence)
            else:
                rate = (job.stats.accepted + 1) / (job.stats.drafted + 2)
                confidences.append((rate,) * len(draft))
        pending = self.max_rows // 4 if prefilling else 0  # prompt rows this step will likely carry
        lengths = allocate_drafts(confidences, costs, pending)
        return [len(draft) if draft.drawn else n for (_, draft, _), n in zip(drafted, lengths)]

    @staticmethod
    def _room(job: Job, share: int) -> int:
        """Most draft tokens `job` may verify this step: its share of the rows, and never past
        its token budget (a step commits the drafts and one token more)."""
        return min(share, job.config.max_new_tokens - job.stats.new_tokens - 1)

    def _settle(self, job: Job, draft, part: Part, logits, verify_s: float, draft_s: float) -> list[int] | None:
        """Accept and commit `job`'s part of the forward; returns its committed tokens (None for a
        prompt chunk that is not its last)."""
        _, controller, rule = job.recipe
        sampling = job.config.sampling
        if draft is None:  # a prompt chunk
            if job.sequence.length < job.prefill_to:
                return None
            job.sequence.cache.cache_full_blocks()  # its prompt's blocks, for jobs that share them
            if not job.first_token:  # a preempted job's context is back: it decodes on
                job.state = DECODE
                return None
            committed = [rule(EMPTY_DRAFT, logits, sampling, job.generator).next_token]
            rows = [0]
            job.recipe.drafter.commit(committed, 0)
            job.stats.target_forwards += 1
            job.stats.prefill_s = time.perf_counter() - job.admitted_at
            job.first_token, job.state = False, DECODE
        else:
            verdict = rule(draft, logits, sampling, job.generator)
            committed = settle(job.sequence, job.recipe.drafter, draft, verdict, len(job.context))
            rows = list(range(verdict.n_accepted + 1)) if draft.parents is None else [0, *(i + 1 for i in verdict.path)]
            controller.observe(len(draft), verdict.n_accepted, draft.confidence, verify_s, draft_s)
            job.stats.record_step(len(draft), verdict.n_accepted)
        committed, reason = apply_stops(committed, job.stats.new_tokens, job.config)
        if job.logprobs is not None:
            job.logprobs.record(logits[rows[: len(committed)]], committed)
        job.context += committed
        job.stats.new_tokens += len(committed)
        if reason:
            job.stats.stop_reason = reason
            self._finish(job, reason)
        return committed

    def _reserve(self, job: Job, positions: int) -> bool:
        """Blocks for `positions` of `job`'s sequence, preempting the most recently admitted
        batched job (`job` itself if it is the newest) while the pool is short; False if `job`
        was preempted."""
        while True:
            try:
                job.sequence.cache.reserve(positions)
                return True
            except PoolExhausted:
                victim = max((other for other in self.running if other.batched), key=lambda other: other.admitted_at)
                self._preempt(victim)
                if victim is job:
                    return False

    def _preempt(self, job: Job) -> None:
        """Take `job`'s KV memory back (its full blocks stay in the prefix cache) and queue it
        first; it recomputes its context when it returns."""
        log.info("KV memory full: job %s preempted (%d positions), it will recompute them", job.id, len(job.context))
        job.sequence.release()
        self.running.remove(job)
        job.state = WAITING
        self.waiting.appendleft(job)

