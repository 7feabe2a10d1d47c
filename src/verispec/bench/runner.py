"""The measurement loop: every (prompt, method, repeat) once, recorded as it finishes.

Owns the run settings (`BenchSettings`) and the run directory: `config.json` (the settings plus
facts about the invocation) and the append-only `records.jsonl`, one record per prompt, method and
repeat, flushed to disk after each so an interrupted run loses nothing; `--resume` reruns only the
missing records and refuses when the saved settings differ in anything that changes results.

Fair measurement:
- one short warm-up generation per method (ours and peers) before measuring, not recorded;
- for each prompt, the methods run back to back, in an order rotated per prompt (prompt i starts
  at method i mod M), so drift of the machine's speed hits every method alike; with R repeats the
  whole rotation runs R times per prompt;
- one stopwatch for every method: a generation's `total_s` is the wall time of the whole call
  (ours: `verispec.api.stream` built and consumed, detokenization included; peers: `generate()`).
  Our methods also report the engine's own prefill and decode times; peers report null there.
- CPU seconds (`time.process_time`, plus a peer's own server or worker processes) and energy
  (`energy.EnergyProbe`) are read around the same call; perplexity is scored afterwards, outside the timed region.
- code tasks (a question with `tests`, the `code-tasks` set): after the timed region, the answer's
  code runs with the tests in a sandboxed subprocess (`code_eval.check_completion`, once per
  distinct answer to a question); its record adds CODE_CHECK_FIELDS: `passed` (true/false) and
  `check` (the short reason, e.g. "assertion failed: assert f(2) == 4").
- memory across requests (ANPD's `NgramMemory`, SuffixDecoding's caches, kept in the target's
  attachments) cannot let a method see a prompt twice, nor see another method's outputs: each
  (method, repeat) gets a
  memory of its own, empty when that repeat's pass over the prompt set starts, filled in prompt
  order (so prompt i drafts only from prompts 0..i-1 of the same method and repeat, and from
  itself); the warm-up gets a throwaway one. A `--resume`d run starts these memories empty at
  the first missing record, so it can understate memory's help, never overstate it.
- multi-turn sets (`datasets.read_conversations`): a later turn's prompt re-sends the
  conversation with the answers that the same method (or peer) generated for the earlier turns
  in the same repeat (from the records, so also across `--resume`); the plan runs every earlier
  turn before the turn that follows it.

Does not own the metrics (`metrics`) or any presentation (`report`).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Sequence

from ..api import stream
from ..core.drafters.ngram import MEMORY_ATTACHMENT
from ..core.drafters.suffix import ATTACHMENT as SUFFIX_ATTACHMENT
from ..errors import ConfigError
from ..core.methods import MethodOptions, parse_variant
from ..target.model import Target
from ..target.score import perplexity
from .code_eval import CheckResult, check_completion
from .datasets import Question, encode_question, encode_turn
from .energy import EnergyProbe
from .peers import PEERS, PeerError, PeerSettings

CONFIG_FILE = "config.json"
RECORDS_FILE = "records.jsonl"
WARMUP_TOKENS = 8

RECORD_FIELDS = (
    "question_id", "category", "method", "repeat", "prompt_tokens", "new_tokens", "target_forwards",
    "drafted", "accepted", "accepted_histogram", "prefill_s", "decode_s", "total_s", "cpu_s",
    "energy_j", "perplexity", "token_ids", "text",
)
CODE_CHECK_FIELDS = ("passed", "check")  # after RECORD_FIELDS, in the records of questions with tests


@dataclass(frozen=True)
class BenchSettings:
    """Everything that changes a run's results; `--resume` requires these to be equal."""

    model: str | None  # as resolved for comparison: an absolute path, a hub id, or None (default)
    draft_model: str | None
    dtype: str  # the resolved dtype ("auto" becomes what it picks on this machine)
    dataset: str  # 'builtin', 'spec-bench' or the resolved path of the question file
    dataset_sha256: str
    categories: tuple[str, ...]
    per_category: int | None
    methods: tuple[str, ...]
    peers: tuple[str, ...]
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    repeats: int
    draft_length: int | None
    controller: str | None
    early_exit_layer: int | None  # None when hf-early-exit does not run
    exit_head: str | None = None  # eesd's head directory (None: the shipped one)
    fast: bool = True  # the fast forward path
    block_kernel: bool = True  # exact int8 block weights on the fast path (GGUF models)
    top_k: int = 0
    ngram_memory: bool = True  # anpd and suffix draft also from earlier requests (a variant may override)
    numerics: str = "int8"  # how the block kernel multiplies (model.load)
    device: str = "cpu"  # as resolved: "cpu", "cuda:N" or "auto-map" (model.load)
    compile: bool = False  # the compiled CUDA decode step (model.load)

    def __post_init__(self) -> None:
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 1:
            raise ConfigError(f"--repeats must be an integer >= 1, got {self.repeats!r}")
        if not self.methods and not self.peers:
            raise ConfigError("nothing to run: give at least one method (--methods) or peer (--peers)")
        for kind, names in (("method", self.methods), ("peer", self.peers)):
            repeated = sorted({n for n in names if names.count(n) > 1})
            if repeated:
                raise ConfigError(f"{kind} listed twice: {', '.join(repeated)}")
        clash = set(self.methods) & set(self.peers)
        if clash:
            raise ConfigError(f"name used as both a method and a peer: {', '.join(sorted(clash))}")
        for name in self.methods:  # each variant's settings go with the run's (before any model loads)
            self.method_options(name)

    @property
    def names(self) -> list[str]:
        """Every method and peer, in the order given: the rotation order."""
        return [*self.methods, *self.peers]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_json(self) -> dict:
        data = asdict(self)
        data.update(categories=list(self.categories), methods=list(self.methods), peers=list(self.peers))
        return data

    def options(self, controller: str | None = None) -> MethodOptions:
        """Method options; `controller` (from a METHOD/CONTROLLER variant) overrides --controller."""
        return MethodOptions(draft_length=self.draft_length, controller=controller or self.controller,
                             exit_head=self.exit_head, draft_model=self.draft_model,
                             ngram_memory=self.ngram_memory)

    def method_options(self, name: str) -> tuple[str, MethodOptions]:
        """(method, options) of a method of the run: a name or a variant (METHOD/CONTROLLER/KEY=VALUE,
        `methods.parse_variant`), its settings over the run's (`options`); a ConfigError where
        they do not go together (e.g. suffix/max_cached_requests=5 in a --no-ngram-memory run)."""
        method, controller, overrides = parse_variant(name)
        return method, replace(self.options(controller), **overrides)

    def peer_settings(self) -> PeerSettings:
        layer = self.early_exit_layer if self.early_exit_layer is not None else PeerSettings.early_exit_layer
        return PeerSettings(self.temperature, self.top_p, self.seed, layer, self.draft_model, self.dtype, self.top_k)


# -- the run directory ------------------------------------------------------------------------


def settings_differences(saved: dict, current: dict) -> list[str]:
    """'name: saved -> now' for each setting that differs."""
    keys = list(dict.fromkeys([*saved, *current]))
    return [f"{k}: {saved.get(k)!r} (saved) vs {current.get(k)!r} (now)" for k in keys if saved.get(k) != current.get(k)]


def check_run_dir(out_dir: Path, settings: BenchSettings, resume: bool) -> None:
    """Before anything loads: refuse to overwrite a run, or to resume one made differently."""
    config_path, records_path = out_dir / CONFIG_FILE, out_dir / RECORDS_FILE
    if not resume:
        if config_path.exists() or (records_path.exists() and records_path.stat().st_size > 0):
            raise ConfigError(f"{out_dir} already holds a benchmark run; pass --resume to continue it, or choose another --out")
        if out_dir.exists() and not out_dir.is_dir():
            raise ConfigError(f"--out {out_dir} exists and is not a directory")
        return
    if not config_path.is_file():
        raise ConfigError(f"nothing to resume in {out_dir}: no {CONFIG_FILE} there")
    try:
        saved = json.loads(config_path.read_text())["settings"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"cannot resume: {config_path} is unreadable ({error})") from None
    differences = settings_differences(saved, settings.to_json())
    if differences:
        raise ConfigError(
            f"refusing to resume {out_dir}: it was run with different settings, which would mix "
            f"incomparable results ({'; '.join(differences)}). Rerun with the original flags, or use a new --out."
        )


def start_run(out_dir: Path, settings: BenchSettings, info: dict, resume: bool) -> dict:
    """Write config.json for a new run (or note the resumption in it); return its contents."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config_path = out_dir / CONFIG_FILE
    if resume:
        config = json.loads(config_path.read_text())
        config.setdefault("resumed", []).append(info)
    else:
        config = {"settings": settings.to_json(), "info": info, "resumed": []}
    temporary = config_path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(config, indent=2) + "\n")
    temporary.replace(config_path)
    return config


def read_records(path: Path) -> list[dict]:
    """The records written so far. A torn last line (the run was killed mid-write) is dropped and
    cut from the file; a bad line anywhere else is an error naming it."""
    if not path.exists():
        return []
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    records, good_bytes = [], 0
    for number, line in enumerate(lines, 1):
        if not line.strip():
            good_bytes += len(line) + 1
            continue
        try:
            record = json.loads(line)
            missing = [f for f in ("question_id", "method", "repeat", "new_tokens", "total_s") if f not in record]
            if missing:
                raise ValueError(f"missing {', '.join(missing)}")
        except ValueError as error:
            if all(not rest.strip() for rest in lines[number:]):  # the last line: torn by a kill
                with open(path, "r+b") as handle:
                    handle.truncate(min(good_bytes, len(raw)))
                break
            raise ConfigError(f"{path}, line {number}: not a valid record ({error})") from None
        records.append(record)
        good_bytes += len(line) + 1
    return records


class RecordWriter:
    """Appends one JSON line per record, flushed and synced before the next run starts."""

    def __init__(self, path: Path):
        self.path = path
        self._file = open(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


# -- measuring one generation -----------------------------------------------------------------


@dataclass
class Outcome:
    """What one generation produced, before timing and scoring are attached."""

    token_ids: list[int]
    target_forwards: int | None
    drafted: int | None = None
    accepted: int | None = None
    accepted_histogram: list[int] | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    text: str | None = None  # None: decoded after timing
    other_cpu_s: float | None = 0.0  # CPU seconds in other processes (a peer's server or worker); None: unknown


Generate = Callable[[Sequence[int], int], Outcome]  # (prompt ids, max_new_tokens) -> Outcome


def method_runner(target: Target, name: str, settings: BenchSettings) -> Generate:
    """One of our methods, built through `verispec.api.stream` (any name in `METHODS`, or a
    METHOD/CONTROLLER variant)."""
    method, options = settings.method_options(name)

    def run(prompt_ids: Sequence[int], max_new_tokens: int) -> Outcome:
        text_stream = stream(
            target, list(prompt_ids), method, max_new_tokens=max_new_tokens, temperature=settings.temperature,
            top_p=settings.top_p, top_k=settings.top_k, seed=settings.seed, options=options,
        )
        for _ in text_stream:
            pass
        result = text_stream.result
        stats = result.stats
        return Outcome(
            list(result.token_ids), stats.target_forwards, stats.drafted, stats.accepted,
            list(stats.accepted_histogram), stats.prefill_s, stats.decode_s, result.text,
        )

    return run


def peer_runner(target: Target, name: str, settings: BenchSettings) -> Generate:
    """A peer from `peers.PEERS`, prepared once (e.g. its draft model loaded)."""
    peer = PEERS[name]
    peer_settings = settings.peer_settings()
    peer.check(peer_settings, target)
    run_peer = peer.prepare(target, peer_settings)

    def run(prompt_ids: Sequence[int], max_new_tokens: int) -> Outcome:
        try:
            output = run_peer(prompt_ids, max_new_tokens)
        except PeerError as error:
            raise PeerError(f"peer {name} failed: {error}") from error
        return Outcome(output.token_ids, output.target_forwards, other_cpu_s=output.other_cpu_s)

    return run


@dataclass
class Timed:
    outcome: Outcome
    total_s: float
    cpu_s: float | None  # this process's CPU time plus the peer's own processes'
    energy_j: float | None


def timed(generate: Generate, prompt_ids: Sequence[int], max_new_tokens: int, probe: EnergyProbe) -> Timed:
    """Run one generation between the readings of every meter: wall clock, CPU time, energy."""
    energy_start = probe.start()
    cpu_start = time.process_time()
    started = time.perf_counter()
    outcome = generate(prompt_ids, max_new_tokens)
    total_s = time.perf_counter() - started
    cpu_s = time.process_time() - cpu_start
    cpu_s = None if outcome.other_cpu_s is None else cpu_s + outcome.other_cpu_s
    return Timed(outcome, total_s, cpu_s, probe.stop(energy_start))


def rotation(names: Sequence[str], index: int) -> list[str]:
    """The method order for prompt `index`: starts at method index mod M."""
    if not names:
        return []
    shift = index % len(names)
    return [*names[shift:], *names[:shift]]


@dataclass
class RunPlan:
    """(question, method, repeat) triples in execution order."""

    steps: list[tuple[int, str, int]] = field(default_factory=list)

    @staticmethod
    def of(questions: Sequence[Question], names: Sequence[str], repeats: int) -> "RunPlan":
        steps = []
        for index in range(len(questions)):
            order = rotation(names, index)
            for repeat in range(repeats):
                steps.extend((index, name, repeat) for name in order)
        return RunPlan(steps)


def run_bench(
    target: Target,
    settings: BenchSettings,
    questions: Sequence[Question],
    out_dir: Path,
    *,
    progress: bool = True,
    probe: EnergyProbe | None = None,
    log: Callable[[str], None] = lambda message: None,
) -> list[dict]:
    """Measure everything not yet in `out_dir/records.jsonl`; return all records of the run."""
    records_path = out_dir / RECORDS_FILE
    existing = read_records(records_path)
    done = {(str(r["question_id"]), r["method"], int(r["repeat"])) for r in existing}
    plan = RunPlan.of(questions, settings.names, settings.repeats)
    todo = [(i, name, r) for i, name, r in plan.steps if (questions[i].key, name, r) not in done]
    by_key = {q.key: q for q in questions}
    position = {q.key: i for i, q in enumerate(questions)}
    for i, question in enumerate(questions):
        if question.follows is not None and position.get(question.follows, i) >= i:
            raise ConfigError(f"question {question.question_id} follows {question.follows!r}, which is not asked before it")
    # A later turn's prompt is known only once the earlier answers are: None here, and its
    # context check uses a bound (empty answers + the budget of each earlier answer, with slack).
    prompts = [None if q.follows else encode_question(target.tokenizer, q) for q in questions]
    for question, ids in zip(questions, prompts):
        if ids is None:
            ids = encode_turn(target.tokenizer, question, [""] * len(question.earlier))
            length = len(ids) + (settings.max_new_tokens + 8) * len(question.earlier)
        else:
            length = len(ids)
        _check_context(target, question, length, settings.max_new_tokens)
    if not todo:
        log(f"all {len(plan.steps)} runs are already recorded in {records_path}")
        return existing

    probe = probe or EnergyProbe()
    runners: dict[str, Generate] = {}
    for name in settings.methods:
        runners[name] = method_runner(target, name, settings)
    for name in settings.peers:
        runners[name] = peer_runner(target, name, settings)
    memories = _Memories(target)
    warmup_tokens = min(WARMUP_TOKENS, settings.max_new_tokens)
    first = next(i for i, prompt in enumerate(prompts) if prompt is not None)
    try:
        for name in settings.names:  # warm-up: not timed, not recorded, its memory thrown away
            memories.use(("warm-up", name))
            runners[name](prompts[first], warmup_tokens)

        from tqdm import tqdm

        answers = {(str(r["question_id"]), r["method"], int(r["repeat"])): r["text"] for r in existing}
        writer = RecordWriter(records_path)
        scores: dict[tuple, float] = {}
        checks: dict[tuple, CheckResult] = {}
        new_records = []
        try:
            with tqdm(total=len(plan.steps), initial=len(plan.steps) - len(todo), disable=not progress,
                      desc="bench", unit="run", dynamic_ncols=True) as bar:
                for index, name, repeat in todo:
                    question = questions[index]
                    ids = prompts[index]
                    if ids is None:
                        ids = encode_turn(target.tokenizer, question, _earlier_answers(question, by_key, answers, name, repeat))
                        _check_context(target, question, len(ids), settings.max_new_tokens)
                    bar.set_postfix_str(f"{question.category}/{question.question_id} {name}")
                    memories.use((name, repeat))
                    result = timed(runners[name], ids, settings.max_new_tokens, probe)
                    record = _record(target, question, ids, name, repeat, result, scores, checks)
                    writer.write(record)
                    answers[(question.key, name, repeat)] = record["text"]
                    new_records.append(record)
                    bar.update(1)
        finally:
            writer.close()
    finally:
        memories.restore()
    return existing + new_records


def _check_context(target: Target, question: Question, prompt_tokens: int, max_new_tokens: int) -> None:
    if prompt_tokens + max_new_tokens > target.max_length:
        raise ConfigError(
            f"question {question.question_id}: prompt ({prompt_tokens} tokens) + --max-new-tokens "
            f"({max_new_tokens}) exceeds the model's context of {target.max_length} tokens"
        )


def _earlier_answers(question: Question, by_key: dict, answers: dict, name: str, repeat: int) -> list[str]:
    """The texts `name` generated in `repeat` for the turns before `question`, oldest first."""
    chain = []
    key = question.follows
    while key is not None:
        if (key, name, repeat) not in answers:
            raise ConfigError(f"question {question.question_id}: {name} has no answer to {key} (repeat {repeat}) yet")
        chain.append(answers[(key, name, repeat)])
        key = by_key[key].follows
    return chain[::-1]


class _Memories:
    """Puts one memory across requests per scope into the target's attachments (ANPD's n-gram
    store and SuffixDecoding's caches; see the module docstring), and restores what was there. A
    target whose memory is switched off (`drafters.base.switch_off_memory`) keeps it off: the
    drafters read that switch, not these stores."""

    KEYS = (MEMORY_ATTACHMENT, SUFFIX_ATTACHMENT)

    def __init__(self, target: Target):
        self.attachments = target.attachments
        self.saved = {key: (key in self.attachments, self.attachments.get(key)) for key in self.KEYS}
        self.scopes: dict[tuple, dict] = {}

    def use(self, scope: tuple) -> None:
        for key in self.KEYS:
            self.attachments[key] = self.scopes.setdefault((key, scope), {})

    def restore(self) -> None:
        for key, (had, saved) in self.saved.items():
            if had:
                self.attachments[key] = saved
            else:
                self.attachments.pop(key, None)


def _record(target: Target, question: Question, prompt_ids: list[int], method: str, repeat: int,
            result: Timed, scores: dict, checks: dict) -> dict:
    """One record (see RECORD_FIELDS, and CODE_CHECK_FIELDS for a question with tests);
    perplexity is scored, and a code answer checked, once per distinct output."""
    outcome = result.outcome
    key = (question.key, tuple(outcome.token_ids))
    if key not in scores:
        scores[key] = perplexity(target, prompt_ids, outcome.token_ids)
    score = scores[key]
    text = outcome.text
    if text is None:
        text = target.tokenizer.decode(outcome.token_ids, skip_special_tokens=True)
    record = {
        "question_id": question.question_id,
        "category": question.category,
        "method": method,
        "repeat": repeat,
        "prompt_tokens": len(prompt_ids),
        "new_tokens": len(outcome.token_ids),
        "target_forwards": outcome.target_forwards,
        "drafted": outcome.drafted,
        "accepted": outcome.accepted,
        "accepted_histogram": outcome.accepted_histogram,
        "prefill_s": outcome.prefill_s,
        "decode_s": outcome.decode_s,
        "total_s": result.total_s,
        "cpu_s": result.cpu_s,
        "energy_j": result.energy_j,
        "perplexity": score if score == score else None,  # nan (empty output) -> null
        "token_ids": outcome.token_ids,
        "text": text,
    }
    assert tuple(record) == RECORD_FIELDS
    if question.tests is not None:
        if (question.key, text) not in checks:
            checks[(question.key, text)] = check_completion(text, question.tests, question.entry_point)
        check = checks[(question.key, text)]
        record.update(passed=check.passed, check=check.reason)
    return record


def invocation_info(command: str, model_name: str, dtype_requested: str) -> dict:
    """Facts about this invocation kept in config.json (not compared on resume)."""
    from .. import __version__

    return {
        "command": command,
        "date": datetime.now(timezone.utc).astimezone().isoformat(timespec="seconds"),
        "model_name": model_name,
        "dtype_requested": dtype_requested,
        "verispec": __version__,
    }
