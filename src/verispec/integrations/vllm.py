"""verispec's ANPD drafting inside vLLM, through vLLM's custom proposer hook.

Owns `AnpdProposer`, the class vLLM builds for
`speculative_config={"method": "custom_class", "model": "verispec.integrations.vllm.AnpdProposer",
"num_speculative_tokens": K}`; its settings (`ProposerSettings`, read from the environment variable
VERISPEC_VLLM_ANPD); how each row of a batch finds its drafter from its tokens (`RowStates`); and
how many tokens each row drafts (`control.allocate_drafts`, the batch engine's cut, over `StepCosts`).
How to serve with it: docs/vllm.md.

The hook (vLLM 0.32, `vllm/v1/spec_decode/custom_class_proposer.py` and its call in
`gpu_model_runner.py`, which the CPU runner inherits): vLLM imports the class, builds it with its
`VllmConfig`, and after each step's sampling calls `propose(sampled_token_ids, num_tokens_no_spec,
token_ids_cpu, slot_mappings=...)`: per row of the batch, the tokens the step committed (a list;
empty while the row is still in prefill), the row's length, and every row's tokens
(`token_ids_cpu`: [max_num_reqs, max_model_len] int32, row i's tokens are
`token_ids_cpu[i, :num_tokens_no_spec[i]]`, this step's committed ones included). It returns one
list of draft ids per row, which vLLM verifies like any draft (so outputs never depend on them).
The CPU runner also calls `load_model(model)` on every drafter. The hook gives no request ids
(rows are condensed and reordered between steps, and a step may skip the proposer) and no
per-step draft budget.

Row states (`RowStates`): each request is an `AnpdDrafter` (the same n-gram tables, levels, long
matches and confidences as verispec's `anpd`, `drafters.ngram`), found from the row's tokens: a
row of n tokens that committed s this step continues the state that held exactly its first n - s
tokens, looked up by that length and its last WINDOW tokens; that state learns from the outcome
of its last draft and indexes the s tokens. Otherwise (a new request, a row reused by another
request, steps that skipped the proposer) it resyncs: the longest state whose tokens are a prefix
of the row's (looked up by the first HEAD tokens, its tokens compared in full) indexes the rest,
or a new drafter indexes the whole row. States are kept for the `rows` most recently seen
requests (least recently used out). A wrong match costs speed only: vLLM verifies every draft.
With `memory` (the default), the drafters share one `NgramMemory` (verispec's memory across
requests, bounded the same way) and pool what they learn of the confidence of each kind of match,
so a new request starts from what the batch has learned.

Draft length (`control.allocate_drafts`, the cut `batch.BatchEngine` makes of its own
sequences' drafts): ANPD's confidences are acceptance probabilities, so a row's path
probabilities (their running products) say how many tokens a draft of each length commits on
average. The proposer drafts, over the whole batch, the tokens that maximise the expected tokens
committed per unit of step cost (for one row, verispec's adaptive cut, `control.best_draft_length`),
every row of the batch committing one token whatever the drafts, at most
`num_speculative_tokens` per row and never past the model's length. The cost of a step with D
draft tokens relative to the same step without (`StepCosts`):
- `cost=measured` (default): a `control.CostModel` per batch size (sizes 1-4, then powers of two),
  fed with the time between consecutive calls of `propose` (one engine step: the forward that
  verified the previous drafts, sampling, scheduling) for steps whose rows all continued decoding;
  before any measurement, the `fixed` form below.
- `cost=fixed`: acceptance only, with a linear cost: a forward of B rows and D drafts costs
  (overhead + B + D) / (overhead + B), `overhead` the fixed part of a forward in tokens: the
  batch engine's `control.RowCosts` line a + b R with a = overhead and b = 1 (R = B + D rows),
  fixed instead of fitted.
- `cost=off`: every token ANPD proposes (up to K).
Both costs make a draft token worth less as the batch fills: with B rows, a draft token must
commit more than about B / (overhead + B) tokens on average to pay. A row whose first draft token
is below that bound drafts nothing and skips the rest of the look-up.

Imports only verispec's pure parts (`drafters.ngram`, `control`, `errors`: numpy and torch, which
vLLM has) and never vLLM itself, so `pip install --no-deps verispec` into vLLM's environment is
enough, and `import verispec` never needs vLLM.
"""

from __future__ import annotations

import math
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, fields
from typing import Callable, Sequence

import numpy as np

from ..core.control import CostModel, allocate_drafts
from ..core.drafters.ngram import AnpdDrafter, NgramConfig, NgramMemory
from ..errors import ConfigError, VerispecError

ENVIRONMENT = "VERISPEC_VLLM_ANPD"  # the proposer's settings, e.g. "max_n=4/cost=fixed/overhead=64"
WINDOW = 16  # tokens at a row's end that, with its length, find the state it continues
HEAD = 8  # tokens at a row's start that find candidate states when it resyncs
RESYNC_CANDIDATES = 32  # most recently used states compared in full per head on a resync
COST_GRID = 33  # widths at which a measured cost table is read per step (interpolated between)
COSTS = ("measured", "fixed", "off")
EXTRA_ROWS = 64  # states kept beyond vLLM's max_num_seqs by default


class HookError(VerispecError, TypeError):
    """vLLM called the proposer with something other than what vLLM 0.32's hook passes."""


@dataclass(frozen=True)
class ProposerSettings:
    """The proposer's options (VERISPEC_VLLM_ANPD, `key=value` pairs joined by '/'): n-gram orders
    and the shortest long match copied (as `anpd`'s: max_n, min_n, span_min), memory across
    requests, the cost source (`cost`: measured, fixed or off), the fixed part of a forward in
    tokens (`overhead`: the `fixed` cost, and the prior of `measured`), and how many requests'
    states are kept (`rows`; 0: vLLM's max_num_seqs + EXTRA_ROWS)."""

    max_n: int = 5
    min_n: int = 2
    span_min: int = 8
    memory: bool = True
    cost: str = "measured"
    overhead: float = 16.0
    rows: int = 0

    def __post_init__(self) -> None:
        for name in ("max_n", "min_n", "span_min", "rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{name} must be an integer, got {value!r}")
        self.ngram_config()  # validates the orders and span_min
        if not isinstance(self.memory, bool):
            raise ConfigError(f"memory must be true or false, got {self.memory!r}")
        if self.cost not in COSTS:
            raise ConfigError(f"cost must be one of {', '.join(COSTS)}, got {self.cost!r}")
        if isinstance(self.overhead, bool) or not isinstance(self.overhead, (int, float)) or not (
                math.isfinite(self.overhead) and self.overhead > 0):
            raise ConfigError(f"overhead must be a number > 0 (tokens), got {self.overhead!r}")
        if self.rows < 0:
            raise ConfigError(f"rows must be >= 0 (0: vLLM's max_num_seqs + {EXTRA_ROWS}), got {self.rows}")

    def ngram_config(self) -> NgramConfig:
        return NgramConfig(max_n=self.max_n, min_n=self.min_n, span_min=self.span_min)

    @classmethod
    def parse(cls, text: str) -> "ProposerSettings":
        """Settings from 'key=value/key=value' (empty: the defaults)."""
        kinds = {f.name: type(getattr(cls(), f.name)) for f in fields(cls)}
        values: dict[str, object] = {}
        for item in (part.strip() for part in text.split("/")):
            if not item:
                continue
            key, sep, raw = (s.strip() for s in item.partition("="))
            if not sep or key not in kinds:
                raise ConfigError(f"{ENVIRONMENT}: {item!r} is not a setting; expected key=value with a key among "
                                  f"{', '.join(kinds)}")
            if key in values:
                raise ConfigError(f"{ENVIRONMENT}: {key} is given twice")
            values[key] = _parse_value(key, raw, kinds[key])
        return cls(**values)


def _parse_value(key: str, raw: str, kind: type) -> object:
    if kind is bool:
        words = {"true": True, "on": True, "1": True, "false": False, "off": False, "0": False}
        if raw.lower() not in words:
            raise ConfigError(f"{ENVIRONMENT}: {key} must be true or false, got {raw!r}")
        return words[raw.lower()]
    if kind is str:
        return raw
    try:
        return kind(raw)
    except ValueError:
        raise ConfigError(f"{ENVIRONMENT}: {key} must be {'an integer' if kind is int else 'a number'}, "
                          f"got {raw!r}") from None


class _State:
    """One request's drafter and the tokens it has indexed."""

    __slots__ = ("drafter", "tokens", "length", "proposed", "end", "head")

    def __init__(self, drafter: AnpdDrafter):
        self.drafter = drafter
        self.tokens = np.empty(0, dtype=np.int32)  # [capacity]; the first `length` are the request's
        self.length = 0
        self.proposed = 0  # tokens of its last draft handed to vLLM
        self.end: tuple[int, bytes] | None = None  # its key in RowStates._by_end
        self.head: bytes | None = None  # its key in RowStates._by_head

    def take(self, tokens: np.ndarray) -> None:
        """Hold `tokens` ([n] int32, which start with the tokens held) as the request's tokens."""
        n = len(tokens)
        if n > len(self.tokens):
            grown = np.empty(max(n, 2 * len(self.tokens), 64), dtype=np.int32)
            grown[: self.length] = self.tokens[: self.length]
            self.tokens = grown
        self.tokens[self.length : n] = tokens[self.length :]
        self.length = n


def _end_key(tokens: np.ndarray) -> tuple[int, bytes]:
    return len(tokens), tokens[max(0, len(tokens) - WINDOW) :].tobytes()


class RowStates:
    """The drafters of the requests in flight, found from each row's tokens (see the module
    docstring); at most `capacity` of them, least recently used out."""

    def __init__(self, make: Callable[[], AnpdDrafter], capacity: int):
        if capacity < 1:
            raise ConfigError(f"at least one request's state must be kept, got capacity {capacity}")
        self._make = make
        self.capacity = capacity
        self._used: OrderedDict[int, _State] = OrderedDict()  # id -> state, least recently used first
        self._by_end: dict[tuple[int, bytes], list[_State]] = {}
        self._by_head: dict[bytes, list[_State]] = {}
        self.continued = self.resynced = self.started = 0  # how each row was found, over all calls

    def __len__(self) -> int:
        return len(self._used)

    def follow(self, tokens: np.ndarray, sampled: int, taken: set[int]) -> tuple[_State, bool]:
        """The state of a row whose tokens are `tokens` ([n] int32), the last `sampled` of them
        committed by the step that just ran, brought up to date with them (not one in `taken`:
        the ids of states already found this step; this one is added). -> (the state, whether it
        continued: it held exactly the tokens before this step's, so its last draft was verified
        in this step and learned from)."""
        n = len(tokens)
        before = tokens[: n - sampled]
        state = next((s for s in self._by_end.get(_end_key(before), ()) if id(s) not in taken), None)
        continued = state is not None
        if continued:
            state.drafter.commit(tokens[len(before) :].tolist(), state.proposed)
            self.continued += 1
        else:
            state = self._resync(tokens, taken)
        taken.add(id(state))
        self._index(state, tokens)
        return state, continued

    def _resync(self, tokens: np.ndarray, taken: set[int]) -> _State:
        """The longest state whose tokens are a prefix of `tokens`, caught up with the rest (its
        last draft is not learned from: what became of it is unknown), else a new one."""
        best: _State | None = None
        for h in range(min(len(tokens), HEAD), 0, -1):
            for state in reversed(self._by_head.get(tokens[:h].tobytes(), ())[-RESYNC_CANDIDATES:]):
                if (id(state) not in taken and state.length <= len(tokens) and (best is None or state.length > best.length)
                        and np.array_equal(state.tokens[: state.length], tokens[: state.length])):
                    best = state
        if best is not None:
            best.drafter.commit(tokens[best.length :].tolist(), 0)
            self.resynced += 1
            return best
        state = _State(self._make())
        state.drafter.begin(tokens.tolist())
        self.started += 1
        return state

    def _index(self, state: _State, tokens: np.ndarray) -> None:
        """Hold `tokens` in `state` and file it under its new end (and head), most recently used."""
        if state.end is not None:
            _remove(self._by_end, state.end, state)
        state.take(tokens)
        state.end = _end_key(tokens)
        self._by_end.setdefault(state.end, []).append(state)
        head = tokens[:HEAD].tobytes()
        if head != state.head:
            if state.head is not None:
                _remove(self._by_head, state.head, state)
            state.head = head
            self._by_head.setdefault(head, []).append(state)
        self._used.pop(id(state), None)
        self._used[id(state)] = state
        while len(self._used) > self.capacity:
            _, old = self._used.popitem(last=False)
            _remove(self._by_end, old.end, old)
            _remove(self._by_head, old.head, old)


def _remove(index: dict, key, state: _State) -> None:
    states = index.get(key)
    if states is not None:
        states[:] = [s for s in states if s is not state]
        if not states:
            del index[key]


def batch_bucket(rows: int) -> int:
    """The batch sizes that share a cost table: 1, 2, 3, 4, then each power of two up to the next."""
    return rows if rows <= 4 else 1 << (rows.bit_length() - 1)


class StepCosts:
    """What a step costs with D draft tokens, relative to the same step without (see the module
    docstring: `measured`, `fixed`, `off`): the costs `control.allocate_drafts` cuts the batch's
    drafts under. `fixed` is `control.RowCosts`' line a + b R with a = overhead and b = 1 (in
    tokens), set instead of fitted; `measured` is not a line: it keeps a `control.CostModel` (a
    median per width, interpolated) per batch size, timed from one call of `propose` to the next."""

    def __init__(self, settings: ProposerSettings):
        self.mode = settings.cost
        self.overhead = float(settings.overhead)
        self.tables: dict[int, CostModel] = {}  # batch bucket -> measured costs

    def table(self, rows: int) -> CostModel:
        bucket = batch_bucket(rows)
        if bucket not in self.tables:  # prior: the fixed form, verify(1 + D) = 1 + D / (overhead + rows)
            self.tables[bucket] = CostModel(prior_slope=1.0 / (self.overhead + bucket))
        return self.tables[bucket]

    def relative(self, rows: int, drafted: np.ndarray) -> np.ndarray:
        """[m] relative costs of steps of `rows` rows with `drafted` ([m] int, ascending) draft tokens."""
        if self.mode == "fixed":
            return 1.0 + drafted / (self.overhead + rows)
        table = self.table(rows)
        grid = np.unique(np.linspace(drafted[0], drafted[-1], COST_GRID).round().astype(np.int64))  # [<= COST_GRID]
        return np.interp(drafted, grid, [table.verify(1 + int(d)) for d in grid])

    def observe(self, rows: int, drafted: int, seconds: float) -> None:
        """A step of `rows` rows that verified `drafted` draft tokens took `seconds`."""
        if self.mode == "measured":
            self.table(rows).observe(1 + drafted, seconds)


def first_token_bound(rows: int, relative: Callable[[np.ndarray], np.ndarray], most: int) -> float:
    """The path probability below which a draft's first token is not worth verifying in a batch
    of `rows` rows (with up to `most` draft tokens): rows times the cheapest average cost of a
    draft token. Rows whose first token falls below it draft nothing (`AnpdProposer`)."""
    if most < 1:
        return 1.0
    drafted = np.arange(most + 1)  # [most + 1]
    return float(rows * np.min((relative(drafted)[1:] - 1.0) / drafted[1:]))


class AnpdProposer:
    """ANPD drafts for vLLM's custom proposer hook (`method: custom_class`); see the module
    docstring. Built by vLLM with its `VllmConfig`; reads `speculative_config.num_speculative_tokens`
    (the most a row drafts), `model_config.max_model_len` and `scheduler_config.max_num_seqs`.
    `settings`: a `ProposerSettings` or its text; default: the environment variable
    VERISPEC_VLLM_ANPD, else the defaults."""

    def __init__(self, vllm_config, settings: ProposerSettings | str | None = None):
        try:
            k = vllm_config.speculative_config.num_speculative_tokens
            max_model_len = vllm_config.model_config.max_model_len
            max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        except AttributeError as error:
            raise HookError(f"AnpdProposer needs vLLM's VllmConfig (speculative_config.num_speculative_tokens, "
                            f"model_config.max_model_len, scheduler_config.max_num_seqs): {error}") from None
        for name, value in (("num_speculative_tokens", k), ("max_model_len", max_model_len),
                            ("max_num_seqs", max_num_seqs)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"vLLM's {name} must be an integer >= 1, got {value!r}")
        if settings is None:
            settings = os.environ.get(ENVIRONMENT, "")
        self.settings = settings if isinstance(settings, ProposerSettings) else ProposerSettings.parse(settings)
        self.k, self.max_model_len = k, max_model_len
        config = self.settings.ngram_config()
        memory = NgramMemory(config) if self.settings.memory else None
        outcomes: dict | None = {} if self.settings.memory else None  # own kinds pooled over the batch
        self.states = RowStates(lambda: AnpdDrafter(config, memory, outcomes=outcomes),
                                self.settings.rows or max_num_seqs + EXTRA_ROWS)
        self.costs = StepCosts(self.settings)
        self._previous: tuple[float, int, int] | None = None  # (started, rows, drafted) of the last call
        self.clock: Callable[[], float] = time.perf_counter  # what `cost=measured` times steps with

    def load_model(self, *args, **kwargs) -> None:
        """vLLM's CPU runner calls this on every drafter: there is no draft network to load."""

    def propose(self, sampled_token_ids: Sequence[Sequence[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings=None) -> list[list[int]]:
        """One list of draft ids per row (see the module docstring). `slot_mappings` is unused."""
        started = self.clock()
        rows = len(sampled_token_ids)
        lengths, tokens = _checked(rows, num_tokens_no_spec, token_ids_cpu)  # [>= rows], [>= rows, max_len]
        bound, relative = 0.0, None
        if self.settings.cost != "off":  # the step's costs for 0..rows * k draft tokens, read once
            table = self.costs.relative(rows, np.arange(rows * self.k + 1))  # [rows * k + 1]
            relative = table.__getitem__
            bound = first_token_bound(rows, relative, rows * self.k)
        taken: set[int] = set()
        steady = True  # every row continued its state: the last step was decode only
        found: list[tuple[int, _State, list[int], tuple[float, ...]]] = []
        for i, sampled in enumerate(sampled_token_ids):
            n = int(lengths[i])
            if len(sampled) > n:
                raise HookError(f"row {i} committed {len(sampled)} tokens but holds {n} (num_tokens_no_spec): "
                                f"this proposer follows vLLM 0.32's hook, whose rows include their new tokens")
            if not sampled or n >= self.max_model_len:  # in prefill, or at the model's length
                steady = steady and bool(sampled)
                continue
            row = np.ascontiguousarray(tokens[i, :n], dtype=np.int32)  # [n]
            state, continued = self.states.follow(row, len(sampled), taken)
            steady = steady and continued
            state.proposed = 0
            k = min(self.k, self.max_model_len - n - 1)
            if k < 1:
                continue
            if bound > 0.0:  # a look-up of one token first: most rows of a full batch stop there
                first, confidence = state.drafter.propose_ids(1)
                if not first or confidence[0] <= bound:
                    continue
            draft, confidence = state.drafter.propose_ids(k)
            found.append((i, state, draft, confidence))
        if self.settings.cost == "off":
            cut = [len(draft) for _, _, draft, _ in found]
        else:  # every row commits a token, drafted or not
            cut = allocate_drafts([confidence for *_, confidence in found], relative, committed=rows)
        drafts: list[list[int]] = [[] for _ in range(rows)]
        for (i, state, draft, _), length in zip(found, cut):
            state.proposed = length
            drafts[i] = draft[:length]
        previous, self._previous = self._previous, (started, rows, sum(cut))
        if steady and previous is not None and previous[1] == rows:
            self.costs.observe(rows, previous[2], started - previous[0])
        return drafts


def _checked(rows: int, num_tokens_no_spec, token_ids_cpu) -> tuple[np.ndarray, np.ndarray]:
    """The hook's arrays as NumPy ([rows] lengths, [max_num_reqs, max_model_len] tokens), or one
    HookError naming what differs from vLLM 0.32's call."""
    lengths = np.asarray(num_tokens_no_spec)
    tokens = np.asarray(token_ids_cpu)
    if lengths.ndim != 1 or lengths.shape[0] < rows or not np.issubdtype(lengths.dtype, np.integer):
        raise HookError(f"num_tokens_no_spec must be a 1-D integer array with a length per row ({rows} rows), "
                        f"got shape {lengths.shape} {lengths.dtype}: this proposer follows vLLM 0.32's hook")
    if tokens.ndim != 2 or tokens.shape[0] < rows or not np.issubdtype(tokens.dtype, np.integer):
        raise HookError(f"token_ids_cpu must be a 2-D integer array with a row per request ({rows} rows), "
                        f"got shape {tokens.shape} {tokens.dtype}: this proposer follows vLLM 0.32's hook")
    if rows and (lengths[:rows].min() < 0 or lengths[:rows].max() > tokens.shape[1]):
        raise HookError(f"num_tokens_no_spec has lengths outside 0..{tokens.shape[1]} (token_ids_cpu's width)")
    return lengths, tokens
