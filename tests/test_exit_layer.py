"""The exit layer chosen by measured acceptance and modelled cost (`train.exit_layer`, `train-exit
--exit-layer auto`).

- The cost model: a deeper exit costs more a draft token, a draft pays only with acceptance, and
  the choice follows the measurements: the deeper layer where its acceptance gain outweighs its
  cost, the shallower one where it does not.
- One labelling pass for several layers gives each layer's labels bit for bit as labelling it alone.
- `train_exit_head` with exit_layer "auto": probes each candidate, records the measurements,
  trains the chosen layer (the one whose probe measured best, whatever it is), and a resume keeps
  the choice; the CLI takes `--exit-layer auto` and refuses other words.
"""

from __future__ import annotations

import json

import pytest
import torch

import helpers
from test_eesd import write_word_corpus
from verispec.core.drafters.early_exit import load_head
from verispec.errors import ConfigError
from verispec.train import exit_head, exit_layer
from verispec.train.exit_head import AUTO, CHOICE, TrainConfig, label, label_layers, train_exit_head


class Qwen15Shape:
    """Qwen2.5-1.5B's sizes."""

    hidden_size, intermediate_size, num_attention_heads, num_key_value_heads = 1536, 8960, 12, 2
    num_hidden_layers, vocab_size = 28, 151936


def test_candidates_span_the_depth_and_stay_inside_the_model():
    assert exit_layer.candidates(28) == [2, 4, 8]
    assert exit_layer.candidates(18) == [1, 3, 5]
    assert exit_layer.candidates(2) == [1]


def test_a_deeper_exit_costs_more_a_token_and_acceptance_decides_what_pays():
    costs = [exit_layer.draft_cost(Qwen15Shape, n, 32768) for n in (2, 4, 8)]
    assert costs == sorted(costs) and 0.1 < costs[1] < 0.25  # about 4/28 of a step plus the head
    assert exit_layer.expected_speedup(0.0, costs[1], 4, 28) == (1.0, 0)  # nothing accepted: no draft
    low, _ = exit_layer.expected_speedup(0.4, costs[1], 4, 28)
    high, k = exit_layer.expected_speedup(0.8, costs[1], 4, 28)
    assert 1.0 <= low < high and k >= 2


@pytest.mark.parametrize("deep_acceptance, expected", [(0.85, 8), (0.5, 4)])
def test_the_choice_follows_the_measured_acceptance(deep_acceptance, expected):
    chosen, table = exit_layer.choose({2: 0.3, 4: 0.45, 8: deep_acceptance}, Qwen15Shape, 32768)
    assert chosen == expected
    assert table[chosen]["speedup"] == max(row["speedup"] for row in table.values())


def test_where_no_layer_pays_the_one_closest_to_paying_is_chosen():
    """Short probes measure low acceptance: every layer's speedup is 1.0 (no draft), and the best
    speed of drafting at all ranks them (not the depth)."""
    low = {2: 0.10, 4: 0.22, 8: 0.12}
    chosen, table = exit_layer.choose(low, Qwen15Shape, 32768)
    assert all(row["speedup"] == 1.0 for row in table.values())
    assert chosen == 4 and table[4]["drafting"] == max(row["drafting"] for row in table.values()) < 1.0


def test_one_labelling_pass_gives_each_layers_labels_as_labelling_it_alone():
    target = helpers.make_target("qwen2", seed=2, init=0.3)
    sequences = [helpers.repetitive_prompt(target.vocab_size, seed, period=5, repeats=4)[:20] for seed in (0, 1)]
    exits, finals = label_layers(target, sequences, [2, 1])
    for n in (1, 2):
        alone = label(target, sequences, n)
        for got, expected in zip(exits[n], alone.exit_states):
            assert torch.equal(got, expected), n
        for got, expected in zip(finals, alone.final_states):
            assert torch.equal(got, expected)


@pytest.mark.parametrize("best", [1, 2])
def test_auto_trains_the_layer_whose_probe_measured_best(best, tmp_path, monkeypatch):
    target = helpers.make_target("gemma3", seed=2, init=0.3, tokenizer=helpers.char_tokenizer())  # 3 layers
    monkeypatch.setattr(exit_head, "candidates", lambda layers: [1, 2])
    monkeypatch.setattr(exit_head, "PROBE_EVAL_TOKENS", 64)
    # a tiny model's layers are dwarfed by its head in the cost model: cost them as a real model's
    monkeypatch.setattr(exit_layer, "draft_cost", lambda config, n, vocab: 0.05 * n)
    evaluate = exit_head.evaluate

    def measured(head, labels, indices, full_logits, eval_tokens):  # the probes' acceptance, made decisive
        result = evaluate(head, labels, indices, full_logits, eval_tokens)
        if eval_tokens == 64:  # a probe's evaluation (the config's eval_tokens is larger)
            result["greedy_acceptance"] = 0.9 if head.exit_layer == best else 0.05
        return result

    monkeypatch.setattr(exit_head, "evaluate", measured)
    corpus = tmp_path / "corpus.jsonl"
    write_word_corpus(corpus, documents=12)
    config = TrainConfig(exit_layer=AUTO, draft_vocab=24, sequence_length=32, batch=2, steps=4, probe_steps=2,
                         warmup=1, checkpoint_every=2, eval_tokens=512)
    summary = train_exit_head(target, corpus, tmp_path / "head", config, log=lambda *_: None)
    choice = json.loads((tmp_path / "head" / CHOICE).read_text())
    assert choice["chosen"] == best == summary["config"]["exit_layer"]
    assert set(choice["layers"]) == {"1", "2"} and summary["exit_layer_choice"] == choice
    head, spec = load_head(tmp_path / "head", target.model)
    assert head.exit_layer == spec.exit_layer == best
    # a resume keeps the choice (the probes do not run again)
    monkeypatch.setattr(exit_head, "label_layers", None)
    longer = TrainConfig(**{**config.__dict__, "steps": 6})
    resumed = train_exit_head(target, corpus, tmp_path / "head", longer, resume=True, log=lambda *_: None)
    assert resumed["config"]["exit_layer"] == best and resumed["steps"] == 6


def test_exit_layer_words_other_than_auto_are_refused():
    with pytest.raises(ConfigError, match="exit_layer|exit-layer"):
        TrainConfig(exit_layer="deep")
    with pytest.raises(ConfigError, match="exit-layer"):
        TrainConfig(exit_layer=0)


def test_a_training_run_its_deadline_stops_still_ends_with_the_learning_rate_annealed(monkeypatch):
    """The cosine follows the share of the time budget spent when that is ahead of the share of
    the steps: stopped by time at 24 of 1,000 steps, the last rate is near 0, not near the peak."""
    import random
    import time

    target = helpers.make_target("gemma3", seed=2, init=0.3, tokenizer=helpers.char_tokenizer())
    sequences = [helpers.repetitive_prompt(target.vocab_size, seed, period=5, repeats=4)[:20] for seed in (0, 1)]
    labels = label(target, sequences, 1)
    config = TrainConfig(exit_layer=1, draft_vocab=24, sequence_length=20, batch=2, steps=1000, warmup=1)
    head, optimizer = exit_head._new_head(target, config, list(range(24)))
    clock = iter(range(10**6))  # one tick per reading
    monkeypatch.setattr(time, "perf_counter", lambda: float(next(clock)))
    rates = []
    step, stopped = exit_head._train_steps(head, optimizer, labels, [0, 1], random.Random(0), config, 0, 1000, 25.0,
                                           lambda done: rates.append(optimizer.param_groups[0]["lr"]))
    assert stopped == "time" and 10 < step < 30
    assert rates == sorted(rates, reverse=True) and rates[-1] < 0.05 * config.learning_rate


def test_the_time_budget_counts_from_when_the_run_began_and_leaves_the_last_evaluation_its_time(
        tmp_path, monkeypatch):
    """--max-minutes is the whole run's: what came before training (the corpus the model wrote)
    shortens the training, which stops early enough for the last evaluation to end within the
    budget, yet gets at least MIN_TRAINING_SHARE of it however late it starts. A clock that ticks
    one second a reading (and a minute an evaluation) makes this exact."""
    import time

    target = helpers.make_target("gemma3", seed=2, tokenizer=helpers.char_tokenizer())
    corpus = tmp_path / "corpus.jsonl"
    write_word_corpus(corpus, documents=6)
    seconds = [0.0]

    def clock() -> float:
        seconds[0] += 1
        return seconds[0]

    evaluate = exit_head.evaluate

    def evaluate_for_a_minute(*args, **kwargs):
        seconds[0] += 60
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(time, "perf_counter", clock)
    monkeypatch.setattr(exit_head, "evaluate", evaluate_for_a_minute)
    config = TrainConfig(exit_layer=1, draft_vocab=24, sequence_length=48, batch=2, steps=10**6, warmup=1,
                         max_minutes=10, eval_tokens=16, checkpoint_every=10**6)

    def run(name: str, before: float) -> tuple[dict, float]:
        began = clock() - before
        summary = train_exit_head(target, corpus, tmp_path / name, config, log=lambda *_: None, began=began)
        return summary, seconds[0] - began

    on_time, used = run("on-time", 0)
    assert on_time["stopped_by"] == "time"
    assert 600 - 60 <= used <= 600 + 2, "the last evaluation ended outside the budget"
    late, used_late = run("late", 300)
    assert late["stopped_by"] == "time" and late["steps"] < on_time["steps"] - 50
    assert used_late <= 600 + 2
    too_late, _ = run("too-late", 700)
    floor = exit_head.MIN_TRAINING_SHARE * 600
    assert floor - 2 <= too_late["steps"] <= floor + 2  # one step a clock reading
