"""verispec's ANPD proposer for vLLM's custom proposer hook, without vLLM: a stand-in config and
NumPy batches as vLLM 0.32 passes them (rows condensed and reordered between steps, steps that
skip the proposer, rows in prefill, finished rows reused by new requests), checked against
verispec's own ANPD drafter on the same contexts; the batch draft-length cut; the settings; the
call signature vLLM documents; the module's imports. With vLLM's environment built (`make
vllm`), one end-to-end run in vLLM whose greedy outputs must equal vLLM's without speculation.
"""

from __future__ import annotations

import ast
import inspect
import os
import random
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from verispec.core.control import allocate_drafts, best_draft_length
from verispec.core.drafters.ngram import AnpdDrafter, NgramConfig, NgramMemory
from verispec.errors import ConfigError
from verispec.integrations import vllm as hook
from verispec.integrations.vllm import AnpdProposer, HookError, ProposerSettings

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def stand_in_config(k: int = 6, max_model_len: int = 400, max_num_seqs: int = 8) -> SimpleNamespace:
    """The attributes of vLLM's VllmConfig the proposer reads."""
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k),
                           model_config=SimpleNamespace(max_model_len=max_model_len),
                           scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs))


def text(rng: random.Random, length: int, phrases: list[list[int]]) -> list[int]:
    """Token ids with repeats (phrases reused, some noise), so that n-gram drafts hit and miss."""
    out: list[int] = []
    while len(out) < length:
        out += rng.choice(phrases) if rng.random() < 0.8 else [rng.randrange(200, 260)]
    return out[:length]


@dataclass
class Request:
    """A request as the stand-in engine sees it: its full greedy text (`target`, prompt first),
    the tokens so far, and its reference: verispec's ANPD drafter driven through the engine's
    protocol (begin, propose, commit) on the same contexts."""

    target: list[int]
    tokens: list[int]
    reference: AnpdDrafter
    drafts: list[int] = field(default_factory=list)  # handed to the engine by the proposer
    expected: list[int] = field(default_factory=list)  # the reference's draft, same step
    begun: bool = False
    pending: list[int] = field(default_factory=list)  # committed since the reference last drafted
    last_proposed: int = 0
    prefill_chunks: int = 0  # steps left in prefill (sampled [] from vLLM)

    @property
    def done(self) -> bool:
        return len(self.tokens) >= len(self.target)


class Engine:
    """vLLM's side of the hook, simplified: each step verifies every row's drafts against its
    greedy text (the accepted prefix plus one token), condenses and shuffles the rows, then calls
    `propose` (unless the step skips it); finished requests leave and new ones take their rows.
    Every draft must equal the reference's (prefix of it, when the proposer cuts drafts)."""

    def __init__(self, proposer: AnpdProposer, seed: int, memory: bool, width: int = 400, slots: int = 8):
        self.proposer, self.rng = proposer, random.Random(seed)
        self.width, self.slots = width, slots
        config = proposer.settings.ngram_config()
        self.memory = NgramMemory(config) if memory else None
        self.outcomes: dict | None = {} if memory else None
        self.phrases = [[self.rng.randrange(3, 200) for _ in range(self.rng.randrange(3, 9))] for _ in range(12)]
        self.active: list[Request] = []
        self.calls = 0
        self.drafted = 0
        self.now = 0.0  # simulated seconds: each step costs 10 ms plus 1 ms a verified row

    def clock(self) -> float:
        return self.now

    def new_request(self, prompt_length: int = 40, new_tokens: int = 60) -> Request:
        target = [self.rng.randrange(3, 200)] + text(self.rng, prompt_length + new_tokens - 1, self.phrases)
        config = self.proposer.settings.ngram_config()
        request = Request(target, target[:prompt_length], AnpdDrafter(config, self.memory, outcomes=self.outcomes))
        request.prefill_chunks = self.rng.choice([0, 0, 1, 2])
        return request

    def step(self, skip: bool = False, shuffle: bool = True) -> list[list[int]]:
        self.now += 0.010 + 0.001 * sum(1 + len(request.drafts) for request in self.active)
        sampled_of: dict[int, list[int]] = {}
        for request in self.active:
            if request.prefill_chunks:
                request.prefill_chunks -= 1
                sampled_of[id(request)] = []
                continue
            at = len(request.tokens)
            accepted = 0
            while (accepted < len(request.drafts) and at + accepted + 1 < len(request.target)
                   and request.drafts[accepted] == request.target[at + accepted]):
                accepted += 1
            committed = request.target[at : at + accepted + 1]
            request.tokens += committed
            request.pending += committed
            sampled_of[id(request)] = committed
        if shuffle:
            self.rng.shuffle(self.active)
        rows = len(self.active)
        tokens = np.zeros((self.slots, self.width), dtype=np.int32)  # [max_num_reqs, max_model_len]
        lengths = np.zeros(self.slots, dtype=np.int32)  # [max_num_reqs]
        tokens[:, :] = 7  # stale ids past each row's length, as vLLM leaves them
        for i, request in enumerate(self.active):
            tokens[i, : len(request.tokens)] = request.tokens
            lengths[i] = len(request.tokens)
        sampled = [sampled_of[id(r)] for r in self.active]
        if skip:
            for request in self.active:
                request.drafts = []
            return []
        drafts = self.proposer.propose(sampled, lengths, tokens, slot_mappings=None)
        self.calls += 1
        assert len(drafts) == rows
        for request, draft, committed in zip(self.active, drafts, sampled):
            self.check(request, draft, committed)
        self.active = [r for r in self.active if not r.done]
        return drafts

    def check(self, request: Request, draft: list[int], committed: list[int]) -> None:
        """The reference drafts on the same context, learning from the proposer's cut."""
        assert all(isinstance(t, int) for t in draft)
        n = len(request.tokens)
        k = min(self.proposer.k, self.proposer.max_model_len - n - 1)
        if not committed or n >= self.proposer.max_model_len:
            assert draft == []
            return
        if not request.begun:
            request.reference.begin(request.tokens)
            request.begun = True
        else:
            request.reference.commit(request.pending, request.last_proposed if request.pending == committed else 0)
        request.pending = []
        expected = request.reference.propose(request.tokens, max(k, 0)).tokens.tolist() if k > 0 else []
        assert len(draft) <= max(k, 0)
        assert draft == expected[: len(draft)], (draft, expected)
        if self.proposer.settings.cost == "off":
            assert draft == expected
        request.last_proposed = len(draft)
        request.drafts = draft
        self.drafted += len(draft)


def run_engine(settings: str, seed: int, steps: int = 60, skip_every: int = 0, memory: bool = False,
               k: int = 6, max_model_len: int = 400) -> Engine:
    """`settings` without `memory`: the proposer and the references share the `memory` flag."""
    proposer = AnpdProposer(stand_in_config(k=k, max_model_len=max_model_len), f"{settings}/memory={memory}")
    engine = Engine(proposer, seed, memory, width=max_model_len)
    proposer.clock = engine.clock  # `cost=measured` times the stand-in's steps, not this machine's
    for step in range(steps):
        while len(engine.active) < engine.slots and engine.rng.random() < 0.7:
            engine.active.append(engine.new_request(engine.rng.randrange(1, 60), engine.rng.randrange(5, 80)))
        engine.step(skip=bool(skip_every) and step % skip_every == skip_every - 1)
    return engine


@pytest.mark.parametrize("memory", [False, True])
def test_drafts_equal_verispecs_anpd_drafts_on_the_same_contexts(memory):
    engine = run_engine("cost=off", seed=1, memory=memory)
    states = engine.proposer.states
    assert engine.drafted > 100 and states.started >= 10 and states.continued > 100  # it drafted, rows moved


@pytest.mark.parametrize("cost", ["fixed", "measured"])
def test_cut_drafts_are_prefixes_of_anpds_and_learn_the_same(cost):
    """With the batch cut on, each draft is a prefix of ANPD's draft and both drafters learn from
    the same verified prefixes (`Engine.check` asserts it every step)."""
    engine = run_engine(f"cost={cost}/overhead=4", seed=2, memory=True)
    assert engine.drafted > 50


@pytest.mark.parametrize("memory", [False, True])
def test_steps_that_skip_the_proposer_resync_rows_from_their_tokens(memory):
    engine = run_engine("cost=off", seed=3, skip_every=4, memory=memory)
    states = engine.proposer.states
    assert states.resynced > 10  # found again after skipped steps, without rebuilding them
    assert engine.drafted > 50


def test_rows_that_finish_are_reused_by_new_requests_with_fresh_states():
    proposer = AnpdProposer(stand_in_config(), "cost=off/memory=false")
    engine = Engine(proposer, seed=4, memory=False)
    engine.active = [engine.new_request(30, 10) for _ in range(3)]
    for request in engine.active:
        request.prefill_chunks = 0
    while engine.active:
        engine.step(shuffle=False)
    first = proposer.states.started
    engine.active = [engine.new_request(30, 10) for _ in range(3)]  # the same rows 0..2, new requests
    for request in engine.active:
        request.prefill_chunks = 0
    while engine.active:
        engine.step(shuffle=False)
    assert first == 3 and proposer.states.started == 6


def test_rows_in_prefill_get_no_draft_and_keep_their_state():
    proposer = AnpdProposer(stand_in_config(), "cost=off")
    row = np.array([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 0, 0]], dtype=np.int32)
    assert proposer.propose([[6]], np.array([10]), row) == [[7, 8, 5, 6, 7, 8]]
    before = proposer.states.continued
    assert proposer.propose([[]], np.array([10]), row) == [[]]  # still in prefill: nothing sampled
    row[0, 10] = 7
    assert proposer.propose([[7]], np.array([11]), row)[0][:2] == [8, 5]
    assert proposer.states.continued == before + 1 and proposer.states.started == 1


def test_empty_batches_and_empty_contexts():
    proposer = AnpdProposer(stand_in_config())
    assert proposer.propose([], np.zeros(8, dtype=np.int32), np.zeros((8, 400), dtype=np.int32)) == []
    assert proposer.propose([[], []], np.zeros(8, dtype=np.int32), np.zeros((8, 400), dtype=np.int32)) == [[], []]
    one = np.zeros((1, 400), dtype=np.int32)
    one[0, 0] = 9
    assert proposer.propose([[9]], np.array([1]), one) == [[]]  # one token: nothing to look up yet
    assert len(proposer.states) == 1


@pytest.mark.parametrize("room", [0, 1, 2, 3])
def test_drafts_never_pass_the_models_length(room):
    """k = 6, but only `room` tokens fit after the committed ones (vLLM adds one more per step)."""
    length = 30
    proposer = AnpdProposer(stand_in_config(k=6, max_model_len=length + room + 1), "cost=off")
    tokens = np.tile(np.arange(1, 6, dtype=np.int32), 10)[None, : length + room + 1]  # [1, max_model_len]
    draft = proposer.propose([[int(tokens[0, length - 1])]], np.array([length]), tokens)[0]
    assert len(draft) == room and draft == tokens[0, length : length + room].tolist()
    at_end = AnpdProposer(stand_in_config(k=6, max_model_len=length), "cost=off")
    assert at_end.propose([[int(tokens[0, length - 1])]], np.array([length]), tokens[:, :length]) == [[]]


def test_states_are_bounded_least_recently_used_out():
    proposer = AnpdProposer(stand_in_config(), "rows=3/cost=off")
    tokens = np.arange(1, 801, dtype=np.int32).reshape(8, 100)  # 8 distinct requests
    for i in range(8):
        proposer.propose([[int(tokens[i, 19])]], np.array([20]), tokens[i : i + 1])
    assert len(proposer.states) == 3
    proposer.propose([[int(tokens[7, 20])]], np.array([21]), tokens[7:8])  # the most recent: continued
    proposer.propose([[int(tokens[0, 20])]], np.array([21]), tokens[0:1])  # evicted: started again
    assert proposer.states.continued == 1 and proposer.states.started == 9


def test_identical_rows_get_a_state_each():
    """Two requests with the same tokens (parallel sampling of one prompt) never share a state."""
    proposer = AnpdProposer(stand_in_config(), "cost=off")
    tokens = np.tile(np.array([4, 5, 6, 7], dtype=np.int32), (2, 25))  # [2, 100]
    for n in (20, 21, 22):
        proposer.propose([[int(tokens[0, n - 1])]] * 2, np.array([n, n]), tokens)
    assert proposer.states.started == 2 and proposer.states.continued == 4


def test_one_row_cut_is_verispecs_adaptive_cut():
    rng = np.random.default_rng(0)
    for _ in range(200):
        confidence = rng.uniform(0.05, 0.99, size=rng.integers(1, 12)).tolist()
        overhead = float(rng.uniform(0.5, 40))
        relative = lambda d: 1.0 + np.asarray(d) / (overhead + 1)
        assert allocate_drafts([confidence], relative, committed=1) == [
            best_draft_length(confidence, lambda length: 1.0 + length / (overhead + 1))]


def test_batch_cut_maximises_tokens_per_cost_over_every_prefix_choice():
    rng = np.random.default_rng(1)
    for _ in range(60):
        rows = int(rng.integers(1, 4))
        confidences = [rng.uniform(0.1, 0.99, size=rng.integers(0, 4)).tolist() for _ in range(rows)]
        relative = lambda d, o=float(rng.uniform(0.5, 10)): 1.0 + np.asarray(d) / (o + rows)
        best = max(
            (rows + sum(np.prod(c[:j + 1]) for c, n in zip(confidences, lengths) for j in range(n))) / relative(sum(lengths))
            for lengths in np.ndindex(*[len(c) + 1 for c in confidences]))
        lengths = allocate_drafts(confidences, relative, committed=rows)
        rate = (rows + sum(np.prod(c[:j + 1]) for c, n in zip(confidences, lengths) for j in range(n))) / relative(sum(lengths))
        assert rate == pytest.approx(best)


def test_drafts_shrink_as_the_batch_fills():
    confidence = [0.9, 0.85, 0.8, 0.7, 0.6, 0.5]
    costs = hook.StepCosts(ProposerSettings(cost="fixed", overhead=8))
    per_row = [sum(allocate_drafts([confidence] * rows, lambda d, r=rows: costs.relative(r, d), committed=rows)) / rows
               for rows in (1, 4, 16, 64)]
    assert per_row == sorted(per_row, reverse=True) and per_row[0] > per_row[-1]
    assert hook.first_token_bound(64, lambda d: costs.relative(64, d), 64 * 6) > 0.85  # full batch: stop early


def test_measured_costs_follow_the_steps_time(monkeypatch):
    """The time between calls prices draft tokens: the same requests draft far less when each
    draft token makes a step much slower (a stand-in clock: step seconds = 1 + slope * tokens)."""

    def drafted(slope: float) -> int:
        clock = [0.0]
        monkeypatch.setattr(hook.time, "perf_counter", lambda: clock[0])
        proposer = AnpdProposer(stand_in_config(k=6, max_model_len=3000), "cost=measured/overhead=8/memory=false")
        tokens = np.tile(np.arange(1, 9, dtype=np.int32), (4, 375))  # [4, 3000]: 4 rows, always predictable
        lengths = np.full(4, 40)
        sampled = [[int(tokens[0, 39])]] * 4
        total = 0
        for step in range(120):
            drafts = proposer.propose(sampled, lengths, tokens)
            clock[0] += 1.0 + slope * sum(map(len, drafts))
            sampled = [tokens[i, lengths[i] : lengths[i] + len(d) + 1].tolist() for i, d in enumerate(drafts)]
            lengths = lengths + [len(d) + 1 for d in drafts]
            total += sum(map(len, drafts)) if step >= 60 else 0
        return total

    cheap, dear = drafted(0.001), drafted(0.5)
    assert cheap > 3 * max(dear, 1) and dear < 60


def test_settings_parse_and_refuse_bad_values(monkeypatch):
    settings = ProposerSettings.parse(" max_n=4 / memory=false/cost=fixed/overhead=64/rows=10")
    assert (settings.max_n, settings.memory, settings.cost, settings.overhead, settings.rows) == (4, False, "fixed", 64.0, 10)
    assert ProposerSettings.parse("") == ProposerSettings()
    for bad, says in [("max_n=1", "min_n <= max_n"), ("cost=cheap", "cost must be"), ("overhead=0", "overhead"),
                      ("memory=maybe", "true or false"), ("k=3", "not a setting"), ("max_n=4/max_n=5", "twice"),
                      ("span_min=x", "integer"), ("rows=-1", "rows")]:
        with pytest.raises(ConfigError, match=says):
            ProposerSettings.parse(bad)
    monkeypatch.setenv(hook.ENVIRONMENT, "memory=off/span_min=0")
    proposer = AnpdProposer(stand_in_config())
    assert proposer.settings.memory is False and proposer.settings.span_min == 0


def test_bad_configs_and_inputs_give_one_clear_error():
    with pytest.raises(HookError, match="VllmConfig"):
        AnpdProposer(SimpleNamespace(speculative_config=None))
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        AnpdProposer(stand_in_config(k=0))
    proposer = AnpdProposer(stand_in_config())
    with pytest.raises(HookError, match="token_ids_cpu"):
        proposer.propose([[1]], np.array([3]), np.zeros(10, dtype=np.int32))
    with pytest.raises(HookError, match="num_tokens_no_spec"):
        proposer.propose([[1], [2]], np.array([3]), np.zeros((2, 10), dtype=np.int32))
    with pytest.raises(HookError, match="outside"):
        proposer.propose([[1]], np.array([11]), np.zeros((1, 10), dtype=np.int32))
    with pytest.raises(HookError, match="committed 2 tokens"):
        proposer.propose([[1, 2]], np.array([1]), np.zeros((1, 10), dtype=np.int32))


# vLLM 0.32's calls into a custom proposer class (vllm/v1/spec_decode/custom_class_proposer.py,
# vllm/v1/worker/gpu_model_runner.py's propose_draft_token_ids, cpu_model_runner.py's load_model):
VLLM_CONSTRUCTS = "user_class(vllm_config)"
VLLM_PROPOSES = ("propose", ["sampled_token_ids", "self.input_batch.num_tokens_no_spec",
                             "self.input_batch.token_ids_cpu"], ["slot_mappings"])
VLLM_LOADS = "self.drafter.load_model(self.model)"


def test_the_class_takes_the_calls_vllm_documents():
    signature = inspect.signature(AnpdProposer)
    signature.bind(stand_in_config())  # user_class(vllm_config)
    name, positional, keywords = VLLM_PROPOSES
    propose = inspect.signature(getattr(AnpdProposer, name))
    propose.bind(None, *positional, **{k: None for k in keywords})
    assert list(propose.parameters)[1:4] == ["sampled_token_ids", "num_tokens_no_spec", "token_ids_cpu"]
    inspect.signature(AnpdProposer.load_model).bind(None, object())
    for attribute in ("model", "draft_attn_groups"):  # read by vLLM's GPU runner as a draft network
        assert not hasattr(AnpdProposer(stand_in_config()), attribute)


def vllm_source_dir() -> Path | None:
    """vLLM's installed package directory in its environment (`make vllm`), without importing it."""
    if not VLLM_PYTHON.exists():
        return None
    found = subprocess.run([str(VLLM_PYTHON), "-c", "import importlib.util as u; "
                            "print(u.find_spec('vllm').submodule_search_locations[0])"],
                           capture_output=True, text=True)
    return Path(found.stdout.strip()) if found.returncode == 0 else None


def test_installed_vllm_still_calls_the_hook_as_recorded():
    """Fails loudly if the vLLM in .venv-vllm calls custom proposer classes differently."""
    source = vllm_source_dir()
    if source is None:
        pytest.skip("vLLM's environment is not built here (make vllm)")
    assert VLLM_CONSTRUCTS in (source / "v1/spec_decode/custom_class_proposer.py").read_text()
    assert VLLM_LOADS in (source / "v1/worker/cpu_model_runner.py").read_text()
    tree = ast.parse((source / "v1/worker/gpu_model_runner.py").read_text())
    calls = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                and any(isinstance(c, ast.Constant) and c.value == "custom_class" for c in node.test.comparators)):
            calls += [n for statement in node.body for n in ast.walk(statement)  # not the elif branches
                      if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "propose"]
    assert calls, "vLLM's model runner no longer has a custom_class branch that calls propose"
    for call in calls:
        assert ([ast.unparse(a) for a in call.args], [k.arg for k in call.keywords]) == VLLM_PROPOSES[1:]


def test_the_module_imports_only_verispecs_pure_parts():
    """No vLLM, no transformers, no model or runtime: it installs into vLLM's environment with
    `pip install --no-deps`."""
    code = ("import sys\n"
            "for name in ('transformers', 'vllm', 'gguf', 'typer', 'fastapi', 'safetensors'):\n"
            "    sys.modules[name] = None  # importing them fails\n"
            "import verispec.integrations.vllm\n"
            "loaded = sorted(m for m in sys.modules if m.startswith('verispec'))\n"
            "assert not any(m.startswith(('verispec.target.model', 'verispec.runtime', 'verispec.core.engine', 'verispec.core.methods'))"
            " for m in loaded), loaded\n"
            "print(len(loaded))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
@pytest.mark.long
def test_greedy_outputs_in_vllm_equal_vllms_own():
    """vLLM's CPU build (`make vllm`) on the embedded model: no speculation, then the ANPD
    proposer; every greedy output must be the same (scripts/vllm_bench.py --check, this checkout's
    verispec on the path of vLLM's processes)."""
    if vllm_source_dir() is None:
        pytest.skip("vLLM's environment is not built here (make vllm)")
    done = subprocess.run([str(VLLM_PYTHON), str(ROOT / "scripts" / "vllm_bench.py"), "--check", "--out",
                           str(ROOT / "runs" / "vllm-check")], capture_output=True, text=True,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT / "src")})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
