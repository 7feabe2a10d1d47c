"""Many requests decoded together: the batch loop beside `engine.decode`, reusing its phases.

Owns `BatchEngine`, which runs the decode loops of many requests (`Job`s) in steps. Each step:

1. admit waiting jobs, first come first served, while there are sequence slots and the KV pools
   can cover each one's whole need (`scheduler`: a request's claim is its prompt, its token
   budget and a draft model's scratch rows; a prompt that starts with cached blocks shares them:
   `kv_pool`);
2. every decoding job drafts as `engine.decode` does (`engine.drafting`: its own drafter,
   controller and method); jobs that draft with a draft model paging its KV (`sps`, `mtad`
   with `--draft-model` on a GGUF file or int8 numerics) draft together: each draft position
   is one forward of the draft model over every such job's rows (`_draft`), their length set
   before drafting for the step's goodput (`_model_draft_rooms`); the drafts are then cut
   together for the step's best expected tokens per second (`control.allocate_drafts`: a
   draft row costs more when the forward is already wide), and to what each job's claim
   holds, and the verify rows (chains or trees) join the step's forward;
3. waiting prompts are prefilled in chunks in the same forward, within a row budget
   (`max_rows`), so a long prompt never stalls the sequences already decoding;
4. one forward of the target runs all those rows (`shared_forward.forward_parts`): every row's
   logits are the bits its sequence gets alone;
5. each job accepts, rolls back and commits with `engine.decode`'s own step
   (`engine.Decoding.accept`, and `Decoding.first` after its prompt's last chunk: its rule, its
   own sampling generator, `engine.settle`), and stops on EOS or its token budget
   (`engine.apply_stops`).

So a request's output is the one it gives alone, whatever else runs: greedy outputs token for
token, and seeded sampled outputs of `ar` and the deterministic drafters too (one draw from the
job's own generator per committed token, whatever the draft lengths).

KV memory never runs out mid-run: a job starts only once its whole claim is covered
(`scheduler`), so nothing is preempted, and a request that fits the pool alone always
completes. A request that could never fit is refused when submitted (`PoolExhausted`, with the
reason). Nothing raises out of a step: a job whose drafter, rule or forward fails ends with its
error (a failed shared forward is retried with each job alone, so only the job it fails for
ends), its blocks given back, and the others go on.

Exact batching needs a target whose sequences page their KV in its block pool
(`Target.pages_kv`: the fast path's C layers with int8 numerics, or a GGUF file). A drafter
that runs the target's own first layers in the request's sequence (`eesd`, and `sps` / `mtad`
without a draft model: an exit head; `in_target_sequence`) needs its verify to capture exit
states, so it runs unbatched beside the batch, one `engine.decode` step per batch step on a
sequence of its own, admitted by the same rule. A target without paged KV (float32 numerics,
transformers' forward, a GPU) serves its jobs one at a time, in order.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Iterator

from . import scheduler
from ..target.shared_forward import ALL, LAST, NONE, Part, prepare
from ..runtime.static_kv import Tree
from .control import RowCosts, allocate_drafts, model_draft_length
from .engine import (DecodeConfig, Decoding, Logprobs, Recipe, check_prompt, close_drafter, decode, drafting,
                     verify_tokens)
from ..errors import ConfigError
from ..runtime.kv_pool import PoolExhausted
from .scheduler import Claim, PoolCounts
from ..target.sequence import TargetSequence
from .stats import GenerationStats

log = logging.getLogger("verispec.batch")

WAITING, PREFILL, DECODE, DONE = "waiting", "prefill", "decode", "done"
DEFAULT_MAX_ROWS = 256  # rows of one step's forward (verify rows first, then prompt chunks)
DEFAULT_MAX_SEQUENCES = 64
MAX_MODEL_DRAFT = 8  # the longest draft `_model_draft_rooms` considers (a job's controller may ask less)

_ids = itertools.count(1)


@dataclass
class Holding:
    """A job's claim on one pool (`scheduler.Claim`) and the sequence whose blocks fill it."""

    claim: Claim
    sequence: TargetSequence

    def refresh(self) -> Claim:
        """The claim, with the blocks its sequence holds now."""
        cache = self.sequence.cache
        self.claim.held = len(cache.blocks) if getattr(self.sequence, "paged", False) and cache is not None else 0
        return self.claim


@dataclass(eq=False)
class Job:
    """One request in the batch: the per-sequence state (its tokens, its KV sequence, its
    method's drafter, controller and rule, its stats; once started, its `engine.Decoding` with its
    sampling generator) and its claims on the KV pools it writes (`holdings`)."""

    prompt: list[int]
    recipe: Recipe
    config: DecodeConfig
    stats: GenerationStats
    batched: bool = True  # its rows join the shared forward (else: its own engine.decode)
    id: int = field(default_factory=lambda: next(_ids))
    state: str = WAITING
    context: list[int] = field(default_factory=list)  # the prompt, then every committed token
    sequence: TargetSequence | None = None
    holdings: list[Holding] = field(default_factory=list)
    decoding: Decoding | None = None  # a batched job's decode state, once started
    logprobs: Logprobs | None = None  # where the committed tokens' log-probabilities go, if wanted
    error: BaseException | None = None
    finish_reason: str = ""  # "eos", "length", "cancelled", "error"
    admitted_at: float = 0.0
    steps: Iterator[list[int]] | None = None  # an unbatched job's decode loop

    @property
    def done(self) -> bool:
        return self.state == DONE

    @property
    def positions(self) -> int:
        """The most positions its target sequence may hold (its claim there)."""
        return self.holdings[0].claim.positions


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
        self.draft_costs: dict[int, RowCosts] = {}  # a draft model's forward seconds by rows, by id of its backend
        self.waiting: collections.deque[Job] = collections.deque()
        self.running: list[Job] = []
        self.last_rows = 0  # rows of the last step's shared forward
        self._failed: list[Job] = []  # jobs that ended while being admitted (the next step reports them)

    # -- jobs in and out -------------------------------------------------------------------------
    def refusal(self, prompt_tokens: int, max_new_tokens: int) -> str | None:
        """Why a request of this size could never run on this target's KV pool, or None (the
        check `submit` makes; the server asks it before queueing)."""
        if not self.batches:
            return None
        pool = self.target.pool
        claim = Claim(pool, scheduler.kv_positions(prompt_tokens, max_new_tokens), pool.block)
        return scheduler.never_fits([claim], {pool: self._counts(pool)})

    def submit(self, prompt: list[int], recipe: Recipe, config: DecodeConfig, stats: GenerationStats,
               sequence: TargetSequence | None = None, logprobs: Logprobs | None = None) -> Job:
        """Queue a request (its prompt ids, a fresh recipe, its decode config and stats);
        `sequence`: the target sequence its recipe was built on (a drafter that runs the target's
        layers drafts in it, and runs unbatched), else a new one; `logprobs`: where its tokens'
        log-probabilities go, if asked for. Refuses a prompt
        that is empty, too long for the model (`engine.check_prompt`), or could never fit the KV
        pools (`PoolExhausted`, with the reason)."""
        check_prompt(prompt, config.max_new_tokens, self.target.max_length)
        sequence = sequence or self.target.new_sequence()
        holdings = self._holdings(len(prompt), config.max_new_tokens, recipe, sequence) if self.batches else []
        claims = [holding.claim for holding in holdings]
        why = scheduler.never_fits(claims, {claim.pool: self._counts(claim.pool) for claim in claims})
        if why is not None:
            raise PoolExhausted(f"this request can never fit the KV memory: {why}; lower its max_new_tokens, or give "
                                f"the model more KV memory (kv_memory)")
        stats.prompt_tokens = len(prompt)
        batched = self.batches and not getattr(recipe.drafter, "in_target_sequence", False)
        job = Job(list(prompt), recipe, config, stats, batched=batched, context=list(prompt),
                  sequence=sequence, holdings=holdings, logprobs=logprobs)
        self.waiting.append(job)
        return job

    def _holdings(self, prompt_tokens: int, max_new_tokens: int, recipe: Recipe, sequence) -> list[Holding]:
        """A job's claims: its target sequence's positions, then those of the drafter's own
        sequences (a draft model's: `kv_claims`) that live in a block pool."""
        pool = self.target.pool
        holdings = [Holding(Claim(pool, scheduler.kv_positions(prompt_tokens, max_new_tokens), pool.block), sequence)]
        claims_of = getattr(recipe.drafter, "kv_claims", None)
        for draft_sequence, positions in (claims_of(prompt_tokens, max_new_tokens) if claims_of else ()):
            if draft_sequence.pages_kv:
                draft_pool = draft_sequence.pool
                holdings.append(Holding(Claim(draft_pool, positions, draft_pool.block), draft_sequence))
        return holdings

    @staticmethod
    def _counts(pool) -> PoolCounts:
        return PoolCounts(pool.blocks, pool.free_blocks, pool.block)

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
        """`job` ends: out of the batch, its drafter closed, every block of its sequences given
        back (whatever fails on the way, the job ends)."""
        if job in self.running:
            self.running.remove(job)
        job.state, job.finish_reason, job.error = DONE, reason, error
        job.stats.stop_reason = job.stats.stop_reason or reason
        try:
            if job.steps is not None:
                job.steps.close()  # an unbatched job's loop closes its drafter
            else:
                close_drafter(job.recipe.drafter)
        except Exception:  # noqa: BLE001 - a drafter that fails to close still gives its blocks back
            log.exception("job %s: its drafter failed to close", job.id)
        for holding in job.holdings or [Holding(None, job.sequence)]:
            if holding.sequence is not None:
                holding.sequence.release()

    # -- one step ------------------------------------------------------------------------------
    def step(self) -> list[tuple[Job, list[int]]]:
        """Run one step of every running job (see the module docstring); returns the tokens each
        job committed in it, in job order, including jobs that ended (`Job.done`: then
        `finish_reason`, and `error` for one that failed; its last tokens may be empty). Never
        raises: a failure ends the jobs it concerns."""
        events: list[tuple[Job, list[int]]] = []
        try:
            self.admit()
            events += [(job, []) for job in self._failed]
            batched = [job for job in self.running if job.batched]
            if batched:
                events += self._shared_step(batched)
            for job in [job for job in self.running if not job.batched]:
                events.append((job, self._own_step(job)))
                if not self.batches:
                    break  # a target without paged KV: one job at a time
        except Exception as error:  # noqa: BLE001 - a bug in the engine's own bookkeeping
            log.exception("a batch step failed: its jobs end with the error")
            seen = {id(job) for job, _ in events}
            for job in [*self.running, *self.waiting]:
                self.cancel(job, "error")
                job.error = error
                if id(job) not in seen:
                    events.append((job, []))
        finally:
            self._failed = []
        return events

    def admit(self) -> None:
        """Move waiting jobs to running, first come first served, while there are sequence slots
        and every pool can cover the head job's claim on top of what the running jobs may still
        take (`scheduler.admissible`). A job that cannot start with nothing else running never
        will (blocks held outside the engine): it ends with `PoolExhausted`."""
        while self.waiting and len(self.running) < self.max_sequences:
            job = self.waiting[0]
            if job.batched and self._twin_prefilling(job):
                return  # it starts from the twin's blocks once they are cached (n choices of one prompt)
            if not self.batches and self.running:
                return  # one at a time
            if self.batches and not self._fits(job):
                if self.running:
                    return  # it waits for blocks
                self.waiting.popleft()
                pools = ", ".join(f"{pool.free_blocks} of {pool.blocks}" for pool in {h.claim.pool for h in job.holdings})
                self._fail_admission(job, PoolExhausted(
                    f"KV memory held outside the batch: job {job.id} needs {job.holdings[0].claim.blocks} blocks, "
                    f"{pools} are free"))
                continue
            self.waiting.popleft()
            try:
                self._start(job)
            except Exception as error:  # noqa: BLE001 - a drafter that cannot begin fails its job only
                self._fail_admission(job, error)
                continue
            job.admitted_at = time.perf_counter()
            job.state = PREFILL if job.batched else DECODE
            self.running.append(job)

    def _fail_admission(self, job: Job, error: BaseException) -> None:
        self._finish(job, "error", error)
        self._failed = [*self._failed, job]

    def _fits(self, job: Job) -> bool:
        """Whether every pool can give `job` its claim now (`scheduler.admissible`). Its start
        shares the cached blocks its prompt begins with (batched jobs: exactly those
        `start_from_cache` takes; unbatched ones are counted as sharing none, which can only
        over-count)."""
        running = [holding.refresh() for other in self.running for holding in other.holdings]
        costs: dict = {}
        for index, holding in enumerate(job.holdings):
            claim = holding.claim
            busy = claim.pool.shared_busy(job.prompt) if index == 0 and job.batched else 0
            costs[claim.pool] = costs.get(claim.pool, 0) + scheduler.admission_cost(claim, busy)
        return scheduler.admissible(costs, running, {pool: self._counts(pool) for pool in costs})

    def _twin_prefilling(self, job: Job) -> bool:
        """Whether a running job is still computing the full blocks of the same prompt (`job`
        then starts from them once they are cached). A twin that has gone past them (one that
        started from the cache) leaves nothing more to share; nor does a prompt with no full
        block before its last token."""
        shareable = scheduler.shareable_positions(len(job.prompt), self.target.pool.block)
        return any(other.state == PREFILL and other.prompt == job.prompt and other.sequence.length < shareable
                   for other in self.running if other.batched)

    def _start(self, job: Job) -> None:
        """A batched job's paged sequence, starting from the cached blocks of its prompt; its
        decode state (with its sampling generator) and its drafter's start (an unbatched job's
        decode loop does both)."""
        if not job.batched:
            return
        for twin in self.running:  # what a twin of its prompt has computed so far is shared from now on
            if twin.batched and twin.prompt == job.prompt:
                twin.sequence.cache.cache_full_blocks()
        job.sequence.reset()
        job.sequence.cache.start_from_cache(job.prompt)
        generator = job.config.sampling.generator(device=self.target.device)
        job.decoding = Decoding(job.sequence, job.recipe, job.config, job.stats, job.context, generator, job.logprobs)
        job.recipe.drafter.begin(job.context)

    def _own_step(self, job: Job) -> list[int]:
        """One `engine.decode` step of an unbatched job on its own sequence."""
        try:
            if job.steps is None:
                job.steps = decode(job.sequence, job.recipe, job.prompt, job.config, job.stats, job.logprobs)
            committed = next(job.steps)
        except StopIteration:
            committed = []
        except Exception as error:  # noqa: BLE001 - one job's failure must not end the others
            self._finish(job, "error", error)
            return []
        if job.stats.stop_reason:
            job.steps.close()
            self._finish(job, job.stats.stop_reason)
        return committed

    def _shared_step(self, jobs: list[Job]) -> list[tuple[Job, list[int]]]:
        """Draft, verify in one forward, accept: every batched running job, plus prompt chunks."""
        started = time.perf_counter()
        decoding = [job for job in jobs if job.state == DECODE]
        prefilling = any(job.state == PREFILL for job in jobs)
        share = scheduler.row_share(self.max_rows, len(decoding), prefilling)
        drafted, events = self._draft(decoding, share)  # [(job, its uncut draft, seconds drafting)]
        lengths = self._cut_drafts(drafted, prefilling)
        parts, plans = [], []
        for (job, draft, draft_s), length in zip(drafted, lengths):
            draft = self._within_claim(job, draft.prefix(length))
            tokens, parents = verify_tokens(job.context, draft)
            parts.append(Part(job.sequence, tokens, parents, ALL))
            plans.append((job, draft, draft_s))
        budget = self.max_rows - sum(len(part.tokens) for part in parts)
        for job in [job for job in self.running if job.batched and job.state == PREFILL]:
            chunk = min(len(job.prompt) - job.sequence.length, budget)
            if chunk <= 0:
                break
            end = job.sequence.length + chunk
            parts.append(Part(job.sequence, job.prompt[job.sequence.length : end],
                              logits=LAST if end == len(job.prompt) else NONE))
            plans.append((job, None, 0.0))
            budget -= chunk
        self.last_rows = sum(len(part.tokens) for part in parts)
        if not parts:
            return events
        forward_started = time.perf_counter()
        results = self._forward(parts, [job for job, _, _ in plans], self.target.forward_parts)
        forward_s = time.perf_counter() - forward_started
        if all(draft is not None for _, draft, _ in plans) and None not in results:
            # decode steps only: a prompt chunk's rows fill the kernel's tiles and cost less each
            # than the draft rows this fit prices (with them, b came out at half a draft row's cost)
            self.row_costs.observe(self.last_rows, forward_s)
        for (job, draft, draft_s), part, logits in zip(plans, parts, results):
            if job.done:  # its forward failed
                events.append((job, []))
                continue
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

    def _draft(self, jobs: list[Job], share: int) -> tuple[list, list]:
        """Each decoding job's uncut draft (`engine.drafting`) and the seconds spent on it. The
        drafters that feed a draft model paging its KV advance together: each round runs the
        rows all of them ask for in one forward of that model (`_forward`; each job's seconds
        count its rows' share of it), so n requests' drafts of k tokens cost k draft-model
        forwards, not n * k. A row's logits are the bits it gets alone. Returns
        ([(job, draft, seconds)], [(job, [])] for jobs whose drafter or draft forward failed)."""
        drafted: list = []
        events: list[tuple[Job, list[int]]] = []
        spent: dict[int, float] = {}
        asking: list = []  # (job, its drafting steps, the part it waits for)

        def advance(job: Job, steps, logits) -> None:
            began = time.perf_counter()
            try:
                part = steps.send(logits)
            except StopIteration as stop:
                drafted.append((job, stop.value, spent[job.id] + time.perf_counter() - began))
                return
            except Exception as error:  # noqa: BLE001 - a drafter's failure ends its job only
                self._finish(job, "error", error)
                events.append((job, []))
                return
            spent[job.id] += time.perf_counter() - began
            asking.append((job, steps, part))

        model_rooms = self._model_draft_rooms(jobs)
        for job in jobs:
            drafter, controller, _ = job.recipe
            room = scheduler.draft_room(share, job.config.max_new_tokens - job.stats.new_tokens)
            room = min(room, model_rooms.get(job.id, room))
            spent[job.id] = 0.0
            advance(job, drafting(drafter, controller, job.context, room, True, cut=False), None)
        while asking:
            this_round, asking = asking, []
            for backend in {id(part.sequence.backend): part.sequence.backend for _, _, part in this_round}.values():
                group = [entry for entry in this_round if entry[2].sequence.backend is backend]
                began = time.perf_counter()
                results = self._forward([part for _, _, part in group], [job for job, _, _ in group],
                                        backend.forward_parts)
                rows = sum(len(part.tokens) for _, _, part in group)
                seconds = time.perf_counter() - began
                self.draft_costs.setdefault(id(backend), RowCosts()).observe(rows, seconds)
                for (job, steps, part), logits in zip(group, results):
                    if job.done:  # its draft forward failed
                        steps.close()
                        events.append((job, []))
                        continue
                    spent[job.id] += seconds * len(part.tokens) / rows
                    advance(job, steps, logits)
        return drafted, events

    def _model_draft_rooms(self, jobs: list[Job]) -> dict[int, int]:
        """By job id, the most tokens each job that drafts with a draft model paging its KV may
        draft this step: the length of best expected goodput under the target's and that
        model's fitted costs (`control.model_draft_length`, from each job's acceptance so far),
        decided before drafting. Under load a draft model's rows cost more than they save and
        its jobs draft nothing. A seeded sampled job keeps its own lengths (its draws, and so
        its output, are then the ones it makes alone). Until the target's step costs are
        measured, such jobs draft only alone; the draft model's costs are, until measured, the
        target's scaled by the bytes of weights each reads a token. A job that drafted nothing
        for a while must first catch its draft model up on what it skipped: those rows are
        charged spread over the steps it has left (about two tokens a step)."""
        costs = self.row_costs.fit()
        groups: dict[int, list[tuple[Job, TargetSequence]]] = {}  # by id of the draft model's backend
        for job in jobs:
            sequence = getattr(job.recipe.drafter, "draft_sequence", None)
            sampling = job.config.sampling
            if sequence is None or not sequence.paged or not hasattr(job.recipe.drafter, "proposing"):
                continue
            if not sampling.greedy and sampling.seed is not None:
                continue
            groups.setdefault(id(sequence.backend), []).append((job, sequence))
        if costs is None:  # nothing measured yet: only a job alone drafts
            return {job.id: 0 for members in groups.values() for job, _ in members} if len(jobs) > 1 else {}
        rooms: dict[int, int] = {}
        for backend, members in groups.items():
            draft_costs = self.draft_costs[backend].fit() if backend in self.draft_costs else None
            if draft_costs is None:
                share = members[0][1].weight_bytes_per_token / self.target.weight_bytes_per_token
                draft_costs = (costs[0] * share, costs[1] * share)
            rates = [(job.stats.accepted + 1) / (job.stats.drafted + 2) for job, _ in members]
            catch_up = 0.0
            for job, sequence in members:
                behind = len(job.context) - sequence.length - 2  # rows past a usual step's catch-up
                steps_left = max(1.0, (job.config.max_new_tokens - job.stats.new_tokens) / 2)
                catch_up += max(0, behind) / steps_left
            k = model_draft_length(rates, MAX_MODEL_DRAFT, costs, draft_costs, rows=len(jobs), committed=len(jobs),
                                   catch_up=catch_up)
            rooms.update((job.id, k) for job, _ in members)
        return rooms

    def _forward(self, parts: list[Part], jobs: list[Job], forward) -> list:
        """`forward` (the target's or a draft model's `forward_parts`) over every part; where it
        fails, each part again alone, so that only the jobs whose own rows fail end (with the
        error). Sequences move only when their forward succeeds (`forward_parts`), so a retry
        starts from where they were. Returns the logits of each part (None for a prompt chunk
        that is not its last, or a failed part)."""
        try:
            for part in parts:
                prepare(part)  # blocks inside the job's claim: never short (`scheduler`)
            return forward(parts)
        except Exception as error:  # noqa: BLE001 - a failed forward ends the jobs it fails for, not the engine
            if len(parts) == 1:
                log.exception("a batched forward failed")
                self._finish(jobs[0], "error", error)
                return [None]
            log.warning("a batched forward of %d parts failed (%r): each part runs alone", len(parts), error)
        results = []
        for part, job in zip(parts, jobs):
            try:
                results.append(forward([part])[0])
            except Exception as error:  # noqa: BLE001
                log.exception("job %s: its forward failed", job.id)
                self._finish(job, "error", error)
                results.append(None)
        return results

    def _within_claim(self, job: Job, draft):
        """`draft`, cut until its verify stays inside the job's claim: a chain always does (its
        room keeps it within the token budget); a tree's scratch slots may not, near its end."""
        if draft.parents is None:
            return draft
        start = job.sequence.length
        while len(draft) and not scheduler.fits(start + Tree.span([-1, *(draft.parents + 1).tolist()]), job.positions):
            draft = draft.prefix(len(draft) - 1)
        return draft

    def _cut_drafts(self, drafted: list, prefilling: bool) -> list[int]:
        """How much of each job's draft to verify: jointly, for the step's best expected tokens
        per second (`control.allocate_drafts` under the fitted `RowCosts`), from each draft's
        confidences, or where a drafter gives none from its job's acceptance so far. Drawn drafts
        (sampled sps and mtad: their stop rule ran before each draw) stay whole."""
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

    def _settle(self, job: Job, draft, part: Part, logits, verify_s: float, draft_s: float) -> list[int] | None:
        """Accept and commit `job`'s part of the forward (`engine.Decoding`: `first` after its
        prompt, `accept` after a verify, whose seconds are its share of the forward); returns its
        committed tokens (None for a prompt chunk that is not its last)."""
        if draft is None:  # a prompt chunk
            if job.sequence.length < len(job.prompt):
                return None
            job.sequence.cache.cache_full_blocks()  # its prompt's blocks, for jobs that share them
            committed, reason = job.decoding.first(logits)
            job.stats.prefill_s = time.perf_counter() - job.admitted_at
            job.state = DECODE
        else:
            committed, reason = job.decoding.accept(draft, logits, time.perf_counter() - verify_s, draft_s)
        if reason:
            self._finish(job, reason)
        return committed
