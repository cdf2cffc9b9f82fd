"""Host reads of tensor values per target forward (each one a host-device synchronisation on a GPU), per method.

:class:`hf_specdec.syncs.SyncCounter` counts them deterministically on the CPU. Greedy decoding of every method, at
batch 1 and a padded batch of 8, makes at most two reads per target forward beyond what stock ``generate()`` makes
per forward in the same call: the accepted paths read once per step, the rest on the device or on host copies. The
counts do not depend on timing (constant schedules; the runner's costs are measured by a first call, so the counted
call makes no calibration forwards). ``python tests/test_syncs.py`` prints the counts and the lines that read.
"""

import sys

import pytest
import torch

import hf_specdec
from hf_specdec.syncs import SyncCounter
from tiny import on_device, prompts, tiny_model

V = 96
HIDDEN = 32
NEW = 40
BEYOND_STOCK = 2.0


def _target():
    return tiny_model("llama", seed=0, hidden=HIDDEN, layers=2)


def _eagle3():
    from hf_specdec.modeling.eagle3 import Eagle3Config, Eagle3Drafter

    torch.manual_seed(3)
    config = Eagle3Config(hidden_size=HIDDEN, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                          vocab_size=V, draft_vocab_size=V, num_target_layers=2, target_layer_ids=[0, 1, 2],
                          initializer_range=0.5)
    return on_device(Eagle3Drafter(config).eval())


def _dflash():
    from hf_specdec.modeling.dflash import DFlashConfig, DFlashDrafter

    torch.manual_seed(4)
    config = DFlashConfig(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=V, block_size=4, mask_token_id=V - 1,
                          target_layer_ids=[0, 1], num_target_layers=2, initializer_range=0.5)
    return on_device(DFlashDrafter(config).eval())


def _medusa():
    from hf_specdec.modeling.medusa import MedusaConfig, MedusaHeads

    torch.manual_seed(6)
    heads = MedusaHeads(MedusaConfig(hidden_size=HIDDEN, vocab_size=V, medusa_num_heads=3)).eval()
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.5)
    return on_device(heads)


def _mtp(model):
    from hf_specdec.modeling.mtp import MTPConfig, MTPModule, block_config_for

    torch.manual_seed(8)
    module = MTPModule(MTPConfig(block_config=block_config_for(model.config, 1), vocab_size=V))
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.5) if p.dim() > 1 else None
    return on_device(module.eval())


def method(name: str, model):
    """The decoding method ``name`` with tiny drafters for ``model`` and a constant schedule."""
    const = {"draft_length_schedule": "constant"}
    if name == "prompt_lookup":
        return hf_specdec.decoding_method("prompt_lookup", **const)
    if name == "assisted":
        return hf_specdec.decoding_method("assisted", drafter=tiny_model("llama", seed=7, hidden=HIDDEN),
                                          num_speculative_tokens=3, **const)
    if name == "hybrid":
        return hf_specdec.decoding_method("assisted", drafter=tiny_model("llama", seed=7, hidden=HIDDEN),
                                          num_speculative_tokens=3, hybrid="suffix", **const)
    if name == "eagle3":
        return hf_specdec.decoding_method("eagle3", drafter=_eagle3(), tree_top_k=3, tree_depth=4,
                                          tree_total_tokens=10, **const)
    if name == "eagle3_chain":
        return hf_specdec.decoding_method("eagle3", drafter=_eagle3(), num_speculative_tokens=3, **const)
    if name == "dflash":
        return hf_specdec.decoding_method("dflash", drafter=_dflash(), tree_budget=0, **const)
    if name == "dflash_tree":
        return hf_specdec.decoding_method("dflash", drafter=_dflash(), tree_budget=6, **const)
    if name == "medusa":
        return hf_specdec.decoding_method("medusa", drafter=_medusa(),
                                          medusa_choices=[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]], **const)
    if name == "layerskip":
        return hf_specdec.decoding_method("layerskip", exit_layer=1, num_speculative_tokens=3)
    if name == "mtp":
        return hf_specdec.decoding_method("mtp", drafter=_mtp(model), num_speculative_tokens=2, **const)
    if name == "suffix":
        return hf_specdec.decoding_method("suffix", suffix_cache=hf_specdec.SuffixCache(max_sequences=64), **const)
    if name == "lookahead":
        return hf_specdec.decoding_method("lookahead", window_size=2, ngram_size=3, guess_set_size=2, **const)
    raise KeyError(name)


METHODS = ["prompt_lookup", "assisted", "hybrid", "eagle3", "eagle3_chain", "dflash", "dflash_tree", "medusa",
           "layerskip", "mtp", "suffix", "lookahead"]


def _inputs(bsz):
    ids, mask = prompts(bsz, length=16, seed=5)
    ids[:, -6:] = ids[:, -12:-6]  # something to copy for the lookup methods
    return ids, mask


def count(name: str, bsz: int, sites: bool = False):
    """``(reads per target forward, the counter, forwards)`` of one greedy call of ``name`` (``"stock"``: plain
    ``generate()``), counted on a second call after a first one measured the runner's costs."""
    model = _target()
    ids, mask = _inputs(bsz)
    custom = None if name == "stock" else method(name, model)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
              return_dict_in_generate=True)
    if custom is not None:
        kw["custom_generate"] = custom
    model.generate(**kw)  # warm-up: calibration, probes, first-use imports
    with SyncCounter(sites=sites) as syncs:
        out = model.generate(**kw)
    # stock: one forward per new token; speculative: the prefill and every verification (its own count)
    stats = getattr(out, "speculative_stats", None)
    forwards = stats["target_forward_passes"] if stats else out.sequences.shape[1] - ids.shape[1]
    return syncs.count / forwards, syncs, forwards


_STOCK = {}


def stock(bsz):
    if bsz not in _STOCK:
        _STOCK[bsz] = count("stock", bsz)[0]
    return _STOCK[bsz]


@pytest.mark.parametrize("bsz", [1, 8])
@pytest.mark.parametrize("name", METHODS)
def test_at_most_two_host_reads_per_forward_beyond_stock(name, bsz):
    per_forward, syncs, forwards = count(name, bsz, sites=True)
    assert forwards > 1
    assert per_forward <= stock(bsz) + BEYOND_STOCK, (
        f"{name} at batch {bsz}: {per_forward:.2f} host reads per target forward, stock generate() "
        f"{stock(bsz):.2f}; where: {syncs.by_site.most_common(6)}")


def test_counter_sees_each_kind_of_read():
    t = torch.arange(6)
    with SyncCounter() as syncs:
        t.tolist(), t[0].item(), bool(t[1]), int(t[2]), float(t[3]), t.nonzero(), t[t > 2], torch.equal(t, t)
        t.unique(), torch.where(t > 1), t.repeat_interleave(t), t.cpu(), t.masked_select(t > 0)
        t + 1, t[1:3], t.sum(), torch.where(t > 1, t, 0), t.repeat_interleave(2)  # no reads
    assert syncs.count == 13, syncs.by_name


if __name__ == "__main__":
    names = sys.argv[1:] or METHODS
    for bsz in (1, 8):
        print(f"batch {bsz}: stock {stock(bsz):.2f} per forward")
        for name in names:
            per_forward, syncs, forwards = count(name, bsz, sites=True)
            print(f"  {name:14s} {per_forward:6.2f} per forward ({syncs.count} in {forwards} forwards) "
                  f"{dict(syncs.by_name)}")
            for site, n in syncs.by_site.most_common(5):
                print(f"      {n:4d} {site}")
