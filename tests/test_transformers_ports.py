"""transformers' own assisted-decoding tests (tests/generation/test_utils.py, GenerationTesterMixin), run against
hf_specdec's loop on every test architecture.

Adapted: hf_specdec refuses ``output_hidden_states``/``output_attentions`` (the target runs on draft trees), so those
flags are dropped; ``eos_token_id=-1`` (never generated), ``max_new_tokens=4`` (at least two target forwards) and two
drafts per step (``num_speculative_tokens=2`` / ``prompt_lookup_num_tokens=2``, constant) are kept.
"""

import pytest
import torch

import hf_specdec
from hf_specdec.proposers.prompt_lookup import PromptLookupProposer
from tiny import ARCHS, prompts, tiny_model

KW = dict(eos_token_id=-1, max_new_tokens=4, num_beams=1, output_scores=True, output_logits=True,
          return_dict_in_generate=True, use_cache=True)


def _check_similar(a, b):
    """Same sequences; scores and logits equal up to matmul-shape rounding."""
    assert torch.equal(a.sequences, b.sequences)
    assert len(a.scores) == len(b.scores) == len(a.logits) == len(b.logits)
    for x, y in zip(a.scores, b.scores):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
    for x, y in zip(a.logits, b.logits):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


def _check_outputs(out, bsz, prompt_len, vocab):
    assert out.sequences.shape == (bsz, prompt_len + 4)
    assert len(out.scores) == 4 and all(s.shape == (bsz, vocab) for s in out.scores)
    assert len(out.logits) == 4 and all(s.shape == (bsz, vocab) for s in out.logits)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("assistant_type", ["random", "same"])
def test_assisted_decoding_matches_greedy_search(arch, assistant_type):
    model = tiny_model(arch)
    ids, mask = prompts(1, 10, seed=2)
    greedy = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, **KW)
    assistant = model if assistant_type == "same" else tiny_model(arch, seed=11)
    assisted = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, **KW,
                              custom_generate=hf_specdec.custom_generate_path("assisted"), trust_remote_code=True,
                              assistant_model=assistant, num_speculative_tokens=2)
    _check_similar(greedy, assisted)
    for out in (greedy, assisted):
        _check_outputs(out, 1, ids.shape[1], model.config.vocab_size)


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_lookup_decoding_matches_greedy_search(arch):
    model = tiny_model(arch)
    ids, mask = prompts(1, 10, seed=3)
    greedy = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, **KW)
    lookup = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, **KW,
                            custom_generate=hf_specdec.custom_generate_path("prompt_lookup"), trust_remote_code=True,
                            prompt_lookup_num_tokens=2, draft_length_schedule="constant")
    _check_similar(greedy, lookup)
    for out in (greedy, lookup):
        _check_outputs(out, 1, ids.shape[1], model.config.vocab_size)


@pytest.mark.parametrize("arch", ARCHS)
def test_assisted_decoding_sample(arch):
    # seeded sampling cannot match plain sampling draw for draw (different forward shapes); check the outputs
    model = tiny_model(arch)
    ids, mask = prompts(1, 10, seed=4)
    torch.manual_seed(0)
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, **KW,
                         custom_generate=hf_specdec.custom_generate_path("assisted"), trust_remote_code=True,
                         assistant_model=model, num_speculative_tokens=2)
    _check_outputs(out, 1, ids.shape[1], model.config.vocab_size)
    assert out.speculative_stats["proposed_drafts"] > 0


class _State:
    """The few fields of DecodingState a proposer reads."""

    def __init__(self, ids, eos):
        self.batch_size = 1
        self.device = ids.device
        self.tokens = ids
        self.lengths = [ids.shape[1]]
        self.pad_lengths = [0]
        self.max_drafts = [8]
        self.eos_token_ids = eos
        from hf_specdec.costs import ForwardCostModel

        self.cost_model = ForwardCostModel()

    def row_tokens(self, b):
        return self.tokens[b]

    def row_list(self, b):
        return self.tokens[b].tolist()

    def roots(self):
        return self.tokens[:, -1]


def test_prompt_lookup_decoding_stops_at_eos():
    # A unigram repeated twice: at the end of the input and at position 3, followed by EOS at position 4. A
    # proposal copied from there must not contain the EOS (nor anything after it).
    ids = torch.randint(1, 50, (1, 10))
    ngram = 51
    ids[:, 3] = ngram
    ids[:, -1] = ngram
    eos = 0
    ids[:, 4] = eos
    proposer = PromptLookupProposer(num_tokens=4, max_ngram=1, adaptive=False)
    state = _State(ids, [eos])
    proposer.begin(state)
    assert proposer.propose(state) is None
    # and end to end: an EOS copied in a draft stops generation exactly where plain generate() stops
    model = tiny_model("llama")
    prompt = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]])
    free = model.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None)
    eos = int(free[0, prompt.shape[1] + 5])
    ref = model.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=eos, pad_token_id=0)
    out = model.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=eos, pad_token_id=0,
                         custom_generate=hf_specdec.decoding_method("prompt_lookup"))
    assert torch.equal(out, ref)
