"""The adaptive rules' switches (:mod:`hf_specdec.adaptive`): with any one rule off, greedy output is still the
target's own ``generate(do_sample=False)`` for every method the rule acts in; every rule on is the default (the same
drafts, step for step, under a deterministic clock); each switch's fallback, on the objects that hold the rule.

The loop is reached as the entry points reach it (:func:`_with_rules`: the proposer built from the method's record,
the runner chosen for the model, ``speculative_decode(..., adaptive_rules=)``), so this file does not depend on the
loop option being registered; :func:`test_the_loop_option_reaches_the_loop` checks the option once it is.
"""

import time

import pytest
import torch

import hf_specdec
from hf_specdec import registry
from hf_specdec.adaptive import ALL_ON, Rules
from hf_specdec.costs import ONE_PRIOR, CallCosts, ForwardCostModel, SpeculationGate, _interp
from hf_specdec.engine import speculative_decode
from hf_specdec.proposers.base import BackOff
from hf_specdec.proposers.build import build_proposer
from hf_specdec.proposers.suffix import _PRIOR
from hf_specdec.runner_choice import runner_for
from test_syncs import HIDDEN, V, _eagle3, _medusa, _mtp
from tiny import one_thread, prompts, tiny_model, word_tokenizer

NEW = 20


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models on one thread (on a busy machine two threads wait for each other's time slices)."""
    with one_thread():
        yield


def _target():
    return tiny_model("llama", seed=0, hidden=HIDDEN, layers=2)


def _dflash(block: int = 8):
    """A DFlash drafter with more block positions than :attr:`DFlashProposer.HEAD_FIRST` (its head-first rule)."""
    from hf_specdec.modeling.dflash import DFlashConfig, DFlashDrafter

    torch.manual_seed(4)
    config = DFlashConfig(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=V, block_size=block, mask_token_id=V - 1,
                          target_layer_ids=[0, 1], num_target_layers=2, initializer_range=0.5)
    return DFlashDrafter(config).eval()


def _universal(target):
    """Method ``universal``'s options with the target's twin over permuted ids as the drafter (test_universal)."""
    from test_universal import _permuted_chars, _twin

    dtok, perm = _permuted_chars()
    return {"drafter": _twin(target, perm), "tokenizer": word_tokenizer(), "assistant_tokenizer": dtok}


def method(name: str, target) -> tuple[str, dict]:
    """``(method, options)`` of a configuration the rules are switched in (adaptive schedules: the defaults); a
    model drafter drafts alone (``hybrid=False``) unless the configuration is a hybrid one (``hybrid_*``), so that
    its own rules act in every step."""
    record, opts = _method(name, target)
    if "hybrid" in registry.get(record).option_names and not name.startswith("hybrid_"):
        opts = {**opts, "hybrid": False}
    return record, opts


def _method(name: str, target) -> tuple[str, dict]:
    if name in ("prompt_lookup", "suffix"):
        return name, {}
    if name == "lookahead":
        return name, {"window_size": 2, "ngram_size": 3, "guess_set_size": 2}
    if name == "assisted":
        return name, {"drafter": tiny_model("llama", seed=7, hidden=HIDDEN)}
    if name == "eagle3":
        return name, {"drafter": _eagle3(), "tree_top_k": 3, "tree_depth": 4, "tree_total_tokens": 10}
    if name == "eagle3_chain":
        return "eagle3", {"drafter": _eagle3(), "num_speculative_tokens": 4}
    if name == "dflash":
        return name, {"drafter": _dflash(), "tree_budget": 0}
    if name == "ddtree":
        return "dflash", {"drafter": _dflash(), "tree_budget": 6}
    if name == "medusa":
        return name, {"drafter": _medusa(), "medusa_choices": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]}
    if name == "mtp":
        return name, {"drafter": _mtp(target), "num_speculative_tokens": 3}
    if name == "layerskip":
        return name, {"exit_layer": 1}
    if name == "hybrid_suffix":
        return "eagle3", {**_method("eagle3", target)[1], "hybrid": "suffix"}
    if name == "hybrid_lookup":
        return "assisted", {**_method("assisted", target)[1], "hybrid": "prompt_lookup"}
    if name == "universal":
        return name, _universal(target)
    raise KeyError(name)


def _with_rules(name: str, opts: dict, rules, seen: list | None = None, built: list | None = None):
    """A decoding callable that runs ``name`` with ``opts`` under ``rules`` as the entry points run a method (its
    proposer built per call, the runner chosen for the model); ``seen`` collects every proposal's drafts, ``built``
    the proposer."""
    def decode(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
               **model_kwargs):
        proposer = build_proposer(name, model, **opts)
        if built is not None:
            built.append(proposer)
        if seen is not None:
            propose = proposer.propose

            def recording(state):
                tree = propose(state)
                seen.append(None if tree is None else (tree.tokens.tolist(), tree.parents.tolist(),
                                                       tree.valid.tolist()))
                return tree

            proposer.propose = recording
        runner = runner_for(model)
        return speculative_decode(model, input_ids, logits_processor, stopping_criteria, generation_config,
                                  proposer=proposer, runner=runner, adaptive_rules=rules, **model_kwargs)

    return decode


def _inputs(bsz: int):
    return prompts(bsz, length=12, seed=bsz, repeat=True)


def _kw(bsz: int) -> dict:
    ids, mask = _inputs(bsz)
    return dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None)


@pytest.fixture(scope="module")
def target():
    return _target()


@pytest.fixture(scope="module")
def references(target):
    return {bsz: target.generate(**_kw(bsz)) for bsz in (1, 3)}


# ------------------------------------------------------------------------------------------------ lossless
# rule -> the configurations (and batch sizes) it acts in, where it is switched off alone
CASES = {
    "measured_costs": [("assisted", 1), ("prompt_lookup", 3)],
    "device_priors": [("eagle3", 1)],
    "recent_minimum": [("dflash", 3), ("layerskip", 1)],
    "exploration": [("dflash", 1), ("lookahead", 1)],
    "gate": [("assisted", 3)],
    "gate_loss_pause": [("eagle3", 3)],
    "gate_quick_retry": [("prompt_lookup", 3)],
    "backoff": [("eagle3_chain", 1), ("medusa", 1)],
    "eagle3_depth_limit": [("eagle3", 1), ("mtp", 3)],
    "dflash_head_first": [("dflash", 3)],
    "hybrid_choice": [("hybrid_suffix", 3), ("hybrid_lookup", 1)],
    "suffix_calibration": [("suffix", 3), ("hybrid_suffix", 1)],
    "lookup_keys": [("prompt_lookup", 1), ("hybrid_lookup", 3)],
    "lookahead_window_pause": [("lookahead", 3)],
    "universal_hopeless": [("universal", 1)],
}
GATED = {"gate", "gate_loss_pause", "gate_quick_retry"}  # with the real gate (conftest opens it for other tests)


def test_every_rule_has_a_case():
    assert list(CASES) == list(Rules.names())


@pytest.mark.parametrize("rule", [pytest.param(r, marks=pytest.mark.gated) if r in GATED else r for r in CASES])
def test_one_rule_off_is_lossless(target, references, rule):
    rules = Rules().without(rule)
    for name, bsz in CASES[rule]:
        out = target.generate(**_kw(bsz), custom_generate=_with_rules(*method(name, target), rules),
                              return_dict_in_generate=True)
        assert torch.equal(out.sequences, references[bsz]), (rule, name, bsz)


# ------------------------------------------------------------------------------------------------ every rule on
@pytest.fixture()
def steady_clock(monkeypatch):
    """``time.perf_counter`` advancing 1 ms per read: every measured time, and so every decision, is a function of
    the code path alone."""
    now = [0.0]

    def perf_counter():
        now[0] += 1e-3
        return now[0]

    monkeypatch.setattr(time, "perf_counter", perf_counter)


@pytest.mark.gated
@pytest.mark.parametrize("name,bsz,elsewhere", [
    ("eagle3", 3, ("suffix_calibration", "lookup_keys", "hybrid_choice", "dflash_head_first",
                   "lookahead_window_pause", "universal_hopeless")),
    ("suffix", 1, ("backoff", "eagle3_depth_limit", "dflash_head_first", "hybrid_choice", "lookup_keys",
                   "lookahead_window_pause", "universal_hopeless")),
])
def test_every_rule_on_is_the_default(steady_clock, name, bsz, elsewhere):
    """``adaptive_rules=None``, ``Rules()`` and ``Rules()`` without rules of other methods propose the same drafts at
    every step (each on a fresh target, so that no call starts from another's measured costs)."""
    runs = []
    for rules in (None, Rules(), Rules().without(*elsewhere)):
        model, seen = _target(), []
        out = model.generate(**_kw(bsz), custom_generate=_with_rules(*method(name, model), rules, seen),
                             return_dict_in_generate=True)
        stats = {k: v for k, v in out.speculative_stats.items() if not k.endswith("seconds")}
        runs.append((out.sequences.tolist(), stats, seen))
    assert runs[0][2] and any(t is not None for t in runs[0][2])
    assert runs[0] == runs[1] == runs[2]


# ------------------------------------------------------------------------------------------------ the fallbacks
@pytest.mark.parametrize("name,bsz,rule,learned", [
    ("suffix", 1, "suffix_calibration", lambda p: any(v != _PRIOR[k[1]] for k, v in p.calibration.items())),
    ("prompt_lookup", 1, "lookup_keys", lambda p: any(isinstance(k, tuple) for k in p.estimator.counts)),
])
def test_a_learning_rule_off_learns_nothing(steady_clock, name, bsz, rule, learned):
    """What a proposer learns by a rule stays at its fallback with the rule off (and is learned with it on)."""
    for rules, learns in ((ALL_ON, True), (Rules().without(rule), False)):
        model, built = _target(), []
        model.generate(**_kw(bsz), custom_generate=_with_rules(*method(name, model), rules, built=built))
        assert learned(built[0]) == learns, (name, rules.off())


def test_rules_are_values():
    rules = Rules().without("gate", "backoff")
    assert rules.off() == ("gate", "backoff") and Rules().off() == () and Rules() == ALL_ON
    assert rules.without("exploration").off() == ("exploration", "gate", "backoff")
    with pytest.raises(ValueError, match="Unknown adaptive rule.*gates; the rules are: measured_costs"):
        Rules().without("gates")
    with pytest.raises(Exception):  # frozen
        rules.gate = True


def _measured() -> ForwardCostModel:
    """A CPU cost model (prior: the fp32 kernel runner's): one token 1 s, four tokens 3, 2 then 5 s (the recent
    minimum 2 s, the latest 5 s)."""
    model = ForwardCostModel("cpu")
    for q, seconds in ((1, 1.0), (1, 1.0), (4, 3.0), (4, 2.0), (4, 5.0)):
        model.record(q, seconds)
    return model


def test_cost_rules_read_the_kept_model_without_changing_it():
    model = _measured()
    assert CallCosts(model).relative(4) == model.relative(4) == 2.0
    assert CallCosts(model, Rules().without("recent_minimum")).relative(4) == 5.0  # the latest sample
    prior = CallCosts(model, Rules().without("measured_costs"))
    assert prior.relative(4) == _interp(model.prior, 4) and prior.step_seconds() == 1.0  # the unit stays measured
    # a size never measured follows the prior's shape from the largest measured one
    assert CallCosts(model).relative(16) == pytest.approx(2.0 * _interp(model.prior, 16) / _interp(model.prior, 4))
    one = CallCosts(model, Rules().without("device_priors"))
    assert one.relative(16) == pytest.approx(2.0 * _interp(ONE_PRIOR, 16) / _interp(ONE_PRIOR, 4))
    assert model.prior is not ONE_PRIOR and CallCosts(model).relative(4) == 2.0  # the kept model is as it was


def test_exploration_switch():
    model = _measured()
    model.clock = 10 * ForwardCostModel.EXPLORE_EVERY
    quiet = CallCosts(model, Rules().without("exploration"))
    assert not quiet.explore_due() and model._explored == 0  # off: the model's clock is not taken
    assert CallCosts(model).explore_due() and model._explored == model.clock


@pytest.mark.gated
def test_gate_switches():
    def closes(rules):
        gate = SpeculationGate()
        for _ in range(gate.WINDOW):
            gate.record(1.0, 2.0, 1.0, rules)  # a third of plain decoding's efficiency
        return gate

    assert closes(ALL_ON).pause > SpeculationGate.FIRST_PAUSE  # sized by the loss
    fixed = closes(Rules().without("gate_loss_pause"))
    assert fixed.pause == fixed.closed_for == SpeculationGate.FIRST_PAUSE
    for rules, judged_after in ((ALL_ON, SpeculationGate.RETRY_WINDOW),
                                (Rules().without("gate_quick_retry"), SpeculationGate.WINDOW)):
        gate = closes(rules)
        gate.closed_for = 0
        for step in range(1, SpeculationGate.WINDOW + 1):
            gate.record(1.0, 2.0, 1.0, rules)
            if gate.closed_for:
                break
        assert step == judged_after


def test_backoff_switches():
    class _State:
        cost_model = CallCosts(_measured())

    def misses(rules):
        backoff = BackOff(rules=rules)
        skipped = []
        for _ in range(3):
            backoff.judge(_State, 0.5, 1.1, 1.0)  # 1.1 tokens for 1.5 steps: does not pay
            skipped.append(backoff.skipping())
        return skipped

    assert misses(ALL_ON) == [True, True, True]  # after each miss
    assert misses(Rules().without("backoff")) == [False, False, False]


# ------------------------------------------------------------------------------------------------ the option
def test_the_loop_option_reaches_the_loop(target, references, monkeypatch):
    if "adaptive_rules" not in {o.name for o in registry.LOOP_OPTIONS}:
        pytest.skip("adaptive_rules is not a loop option (registry.LOOP_OPTIONS) in this checkout")
    from hf_specdec.proposers.prompt_lookup import PromptLookupProposer

    seen = []
    begin = PromptLookupProposer.begin
    monkeypatch.setattr(PromptLookupProposer, "begin",
                        lambda self, state: seen.append(state.rules) or begin(self, state))
    rules = Rules().without("lookup_keys", "exploration")
    out = target.generate(**_kw(1), custom_generate=hf_specdec.decoding_method("prompt_lookup"), adaptive_rules=rules)
    assert torch.equal(out, references[1]) and seen == [rules]
    out = target.generate(**_kw(1), custom_generate=hf_specdec.decoding_method("prompt_lookup", adaptive_rules=rules))
    assert torch.equal(out, references[1]) and seen == [rules, rules]
    out = hf_specdec.generate_with_method("prompt_lookup", target, **_kw(1), adaptive_rules=rules)  # the folders' body
    assert torch.equal(out, references[1]) and seen == [rules, rules, rules]
    with pytest.raises(ValueError, match="adaptive_rules"):
        target.generate(**_kw(1), custom_generate=hf_specdec.decoding_method("prompt_lookup"),
                        adaptive_rules=("gate",))
