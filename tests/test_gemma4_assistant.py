"""gemma4_assistant: transformers' Gemma 4 assistants (shared KV, one position, several tokens) in the batched loop.

Tiny Gemma 4 targets with KV sharing and sliding windows shorter than the sequences, a tiny Gemma 3n target, the
plain, the ordered-embedding and the unified assistant. The drafts equal transformers'
``SinglePositionMultiTokenCandidateGenerator``'s for the same state (after the prefill, after a partial acceptance);
greedy output equals ``generate()`` (batch 1, a padded batch of 3, chains and trees, the assistant as an object or by
repo id from a local Hub cache) and transformers' own ``generate(assistant_model=)``; coupled sampling equals method
``plain``; wrong pairs are refused.
"""

import pytest
import torch
from transformers import (
    Gemma3nForCausalLM,
    Gemma3nTextConfig,
    Gemma4AssistantConfig,
    Gemma4AssistantForCausalLM,
    Gemma4ForCausalLM,
    Gemma4TextConfig,
    Gemma4UnifiedAssistantConfig,
    Gemma4UnifiedAssistantForCausalLM,
    Gemma4UnifiedForCausalLM,
    Gemma4UnifiedTextConfig,
    GenerationConfig,
)
from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator

import hf_specdec
from hf_specdec import cache as cache_ops
from hf_specdec import engine
from hf_specdec.hub_cache import write_cached_repo
from hf_specdec.proposers.gemma4_assistant import Gemma4AssistantProposer, _build, check_pair
from hf_specdec.tree import DraftTree
from tiny import _scale, one_thread, prompts, tiny_model

VOCAB, H, WINDOW = 96, 32, 5  # the window is shorter than every sequence here: it really slides
COMMON = dict(vocab_size=VOCAB, pad_token_id=0, eos_token_id=1, bos_token_id=2, max_position_embeddings=512)
ATTENTION = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=WINDOW)
TYPES = ["sliding_attention", "full_attention"]
GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
METHOD = hf_specdec.decoding_method("gemma4_assistant")


def _sdpa(model):
    for config in (model.config, model.config.get_text_config()):
        config._attn_implementation = "sdpa"
    return model.eval()


# the norms after each sub-block (Gemma's sandwich norms set the scale of what a block adds to the residual)
POST_NORMS = ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight",
              "post_per_layer_input_norm.weight")


def _gemma4_target(seed=0, agree=0.05, unified=False):
    """Layers 0-1 compute KV (sliding, full), 2-3 reuse it (the "store" layers are 0 and 1). ``agree`` scales the
    layers' contributions down: the target is then close to a bigram model of its embeddings that an assistant can
    copy."""
    torch.manual_seed(seed)
    if unified:
        config = Gemma4UnifiedTextConfig(hidden_size=H, intermediate_size=2 * H, num_hidden_layers=4,
                                         global_head_dim=16, layer_types=TYPES * 2, num_kv_shared_layers=2,
                                         tie_word_embeddings=False, **ATTENTION, **COMMON)
        model = Gemma4UnifiedForCausalLM(config)
    else:
        config = Gemma4TextConfig(hidden_size=H, intermediate_size=2 * H, num_hidden_layers=4, global_head_dim=16,
                                  layer_types=TYPES * 2, num_kv_shared_layers=2, hidden_size_per_layer_input=4,
                                  vocab_size_per_layer_input=VOCAB, tie_word_embeddings=False, **ATTENTION,
                                  **COMMON)
        model = Gemma4ForCausalLM(config)
    model = _scale(_sdpa(model), 3.0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(POST_NORMS):
                p.mul_(agree)
        model.get_output_embeddings().weight.mul_(10.0)  # few near-ties between a bigram's top tokens
    return model


def _assistant(target, oracle=True, seed=1, unified=False, ordered=False, hidden=None):
    """A 2-layer assistant for ``target``. ``oracle``: it reads the token's embedding and predicts the target's
    bigram (its attention over the shared KV adds a little), so that some drafts are accepted; else random."""
    torch.manual_seed(seed)
    hidden = hidden or (H if oracle else 16)
    text_cls, cfg_cls, cls = ((Gemma4UnifiedTextConfig, Gemma4UnifiedAssistantConfig, Gemma4UnifiedAssistantForCausalLM)
                              if unified else (Gemma4TextConfig, Gemma4AssistantConfig, Gemma4AssistantForCausalLM))
    extra = {} if unified else dict(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)
    text = text_cls(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, layer_types=TYPES,
                    global_head_dim=target.config.get_text_config().per_layer_config[1].head_dim
                    if hasattr(target.config.get_text_config(), "per_layer_config") else 8,
                    **extra, **ATTENTION, **COMMON)
    ordering = dict(use_ordered_embeddings=True, num_centroids=8, centroid_intermediate_top_k=3) if ordered else {}
    assistant = _sdpa(cls(cfg_cls(text_config=text, backbone_hidden_size=H, **ordering)))
    if ordered:
        assistant.masked_embedding.token_ordering.copy_(torch.randperm(VOCAB))
    _scale(assistant, 3.0)
    if oracle:
        with torch.no_grad():
            assistant.pre_projection.weight.copy_(torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1))
            for name, p in assistant.named_parameters():
                if name.endswith(POST_NORMS):
                    p.mul_(0.05)
            assistant.lm_head.weight.copy_(target.get_output_embeddings().weight)
            assistant.model.norm.weight.copy_(target.base_model.norm.weight)
    return assistant


def _gemma3n_target(seed=0):
    torch.manual_seed(seed)
    config = Gemma3nTextConfig(hidden_size=H, intermediate_size=2 * H, num_hidden_layers=4, layer_types=TYPES * 2,
                               num_kv_shared_layers=2, hidden_size_per_layer_input=4, vocab_size_per_layer_input=VOCAB,
                               laurel_rank=4, altup_num_inputs=2, activation_sparsity_pattern=[0.0] * 4,
                               **ATTENTION, **COMMON)
    return _scale(_sdpa(Gemma3nForCausalLM(config)), 3.0)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: one thread (on a busy 2-core machine two threads wait for each other's time slices, 20x slower)."""
    with one_thread():
        yield


@pytest.fixture(scope="module")
def pair():
    target = _gemma4_target()
    return target, _assistant(target)


# ------------------------------------------------------------------------------------------ drafts = transformers'
class Recording(Gemma4AssistantProposer):
    """Records every proposal: each row's drafts and its committed ids (unpadded). ``forced``: the first proposal's
    chains are replaced by these (one list per row), to make given partial acceptances happen."""

    def __init__(self, *args, forced=None, **kw):
        super().__init__(*args, **kw)
        self.forced, self.seen = forced, []

    def propose(self, state):
        tree = super().propose(state)
        drafts = [tree.tokens[b, 1:1 + n].tolist() for b, n in enumerate(self.counts)]
        self.seen.append(list(zip(drafts, [state.row_list(b) for b in range(state.batch_size)])))
        if self.forced is not None and len(self.seen) == 1:
            tree = DraftTree.chain(state.roots(), torch.tensor(self.forced), [len(f) for f in self.forced])
        return tree


def _compact_every_step(state, target, proposer, stats):
    """engine._make_room that moves every row's real columns together at every step (holes or not)."""
    if state.batch_size == 1:
        return
    index = state.layout.compaction_index()
    cache_ops.gather_columns(state.cache, index)
    state.layout = state.layout.gather(index)
    proposer.on_compact(state, index)
    stats.compactions += 1


def _generator_drafts(target, assistant, committed, k):
    """transformers' candidate generator's ``k`` drafts after ``committed`` (the last id not in the target's KV yet:
    the target's outputs over the ids before it, its last position's hidden state)."""
    seq = torch.tensor([committed])
    with torch.no_grad():
        out = target(input_ids=seq[:, :-1], output_hidden_states=True, return_shared_kv_states=True)
        gen = SinglePositionMultiTokenCandidateGenerator(assistant, target.get_input_embeddings(),
                                                         GenerationConfig(max_length=512))
        gen.num_assistant_tokens = k
        cand, _ = gen.get_candidates(seq, model_kwargs={"attention_mask": torch.ones_like(seq)}, model_outputs=out,
                                     is_first_iteration=False, n_last_matches=0)
    return cand[0, seq.shape[1]:].tolist()


@pytest.mark.parametrize("kind", ["plain", "ordered", "unified"])
def test_drafts_equal_transformers_generator(kind):
    """Random assistants (their attention over the shared KV decides), a window of 5 over 12+ tokens: our chain equals
    the generator's drafts after the prefill and after a step that accepted 2 of 3 drafts."""
    target = _gemma4_target(seed=3, agree=1.0, unified=kind == "unified")
    assistant = _assistant(target, oracle=False, unified=kind == "unified", ordered=kind == "ordered")
    ids, _ = prompts(1, length=12, seed=4)
    truth = target.generate(input_ids=ids, max_new_tokens=4, **GREEDY)[0, 12:].tolist()
    proposer = Recording(assistant, num_tokens=4, forced=[[truth[1], truth[2], (truth[3] + 1) % VOCAB]])
    out = target.generate(input_ids=ids, max_new_tokens=9, custom_generate=hf_specdec.decoding_method(proposer),
                          **GREEDY)
    assert torch.equal(out, target.generate(input_ids=ids, max_new_tokens=9, **GREEDY))
    ((first, at_prefill),), ((second, after),) = proposer.seen[:2]
    assert after[-4:-1] == truth[:3] and len(after) == 12 + 4  # two drafts accepted, the target's token last
    assert first == _generator_drafts(target, assistant, at_prefill, 4)
    assert second == _generator_drafts(target, assistant, after, 4)


@pytest.mark.parametrize("compact", [False, True])
def test_drafts_equal_generator_per_row_with_holes(monkeypatch, compact):
    """A padded batch of 3 whose rows accept 2, 0 and 1 forced drafts (holes in the cache; ``compact``: moved
    together at every step): every row's drafts at every step equal the generator's for that row alone."""
    if compact:
        monkeypatch.setattr(engine, "_make_room", _compact_every_step)
    target = _gemma4_target(seed=3, agree=1.0)
    assistant = _assistant(target, oracle=False)
    ids, mask = prompts(3, length=12, seed=4)
    truth = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, **GREEDY)[:, 12:].tolist()
    wrong = [(t[-1] + 1) % VOCAB for t in truth]
    forced = [[truth[0][1], truth[0][2], wrong[0]], [wrong[1], 3, 3], [truth[2][1], wrong[2], 3]]
    proposer = Recording(assistant, num_tokens=3, forced=forced)
    out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, return_dict_in_generate=True,
                          custom_generate=hf_specdec.decoding_method(proposer), **GREEDY)
    assert (out.speculative_stats["compactions"] > 0) == compact
    assert [len(committed) for _, committed in proposer.seen[1]] == [12 + 4, 10 + 2, 8 + 3]  # accepted 2, 0, 1
    checked = 0
    for step in proposer.seen:
        for drafts, committed in step:
            if drafts:
                assert drafts == _generator_drafts(target, assistant, committed, len(drafts))
                checked += 1
    assert checked >= 9


def test_the_sliding_window_decides_the_drafts():
    """The comparison above has teeth: the assistant's drafts depend on its sliding window over these sequences."""
    target = _gemma4_target(seed=3, agree=1.0)
    assistant = _assistant(target, oracle=False)
    committed = prompts(1, length=12, seed=4)[0][0].tolist() + [7]
    narrow = _generator_drafts(target, assistant, committed, 4)
    assistant.config.text_config.sliding_window = 64
    wide = _generator_drafts(target, assistant, committed, 4)
    assistant.config.text_config.sliding_window = WINDOW
    assert narrow != wide


# ---------------------------------------------------------------------------------------------- greedy = generate()
@pytest.mark.parametrize("width", [1, 2])
@pytest.mark.parametrize("bsz", [1, 3])
def test_greedy_equals_generate(pair, bsz, width):
    target, assistant = pair
    ids, mask = prompts(3, length=12)
    kw = dict(input_ids=ids[:bsz], attention_mask=mask[:bsz], max_new_tokens=20, **GREEDY)
    ref = target.generate(**kw)
    out = target.generate(**kw, custom_generate=METHOD, assistant_model=assistant, num_speculative_tokens=3,
                          tree_width=width, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.speculative_stats["accepted_drafts"] > 0


@pytest.mark.parametrize("width", [1, 2])
def test_greedy_adaptive_length(pair, width):
    """The default draft length: chosen per step from the measured costs and the acceptance."""
    target, assistant = pair
    ids, mask = prompts(3, length=12)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=16, **GREEDY)
    out = target.generate(**kw, custom_generate=METHOD, assistant_model=assistant, tree_width=width)
    assert torch.equal(out, target.generate(**kw))


def test_greedy_equals_transformers_assisted_and_loads_by_repo_id(pair, hub, tmp_path):
    """transformers' own generate(assistant_model=) gives the same text; the assistant saved in the published layout
    and loaded by repo id offline drafts as the object does."""
    target, assistant = pair
    assistant.save_pretrained(tmp_path / "saved")
    files = {p.name: p.read_bytes() for p in (tmp_path / "saved").iterdir() if p.is_file()}
    write_cached_repo(hub, "google/gemma-4-tiny-it-assistant", files)
    ids, _ = prompts(1, length=12)
    kw = dict(input_ids=ids, max_new_tokens=20, **GREEDY)
    ref = target.generate(**kw)
    assistant.generation_config.num_assistant_tokens = 3
    try:
        theirs = target.generate(**kw, assistant_model=assistant)
    finally:
        assistant.generation_config.num_assistant_tokens = None
    ours = target.generate(**kw, custom_generate=METHOD, drafter="google/gemma-4-tiny-it-assistant",
                           num_speculative_tokens=3, return_dict_in_generate=True)
    assert torch.equal(theirs, ref) and torch.equal(ours.sequences, ref)
    assert ours.speculative_stats["accepted_drafts"] > 0


def test_gemma3n_target():
    """A Gemma 3n target (KV sharing, AltUp): its shared KV from the cache, its final state from the LM head's input."""
    target = _gemma3n_target()
    assistant = _assistant(target, oracle=False)
    ids, mask = prompts(3, length=12)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, **GREEDY)
    out = target.generate(**kw, custom_generate=METHOD, assistant_model=assistant, num_speculative_tokens=2)
    assert torch.equal(out, target.generate(**kw))


# ------------------------------------------------------------------------------------------------------ sampling
@pytest.mark.parametrize("width,bsz", [(1, 1), (1, 3), (2, 1), (2, 3)])
def test_coupled_sampling_equals_plain(pair, width, bsz):
    target, assistant = pair
    ids, mask = prompts(3, length=12, seed=5)
    kw = dict(input_ids=ids[:bsz], attention_mask=mask[:bsz], max_new_tokens=16, do_sample=True, temperature=0.8,
              top_p=0.9, eos_token_id=None, pad_token_id=0, seed=11, return_dict_in_generate=True)
    ref = target.generate(**kw, custom_generate=hf_specdec.decoding_method("plain"))
    out = target.generate(**kw, custom_generate=METHOD, assistant_model=assistant, num_speculative_tokens=3,
                          tree_width=width)
    assert out.speculative_stats["sampling"] == "coupled"
    assert torch.equal(out.sequences, ref.sequences)
    assert out.speculative_stats["proposed_drafts"] > 0


@pytest.mark.parametrize("width", [1, 2])
def test_rejection_sampling_runs(pair, width):
    """Exact speculative sampling: chains carry the assistant's distribution (draft_probs), trees are top-k."""
    target, assistant = pair
    ids, mask = prompts(3, length=12, seed=5)
    out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=True, eos_token_id=None,
                          pad_token_id=0, custom_generate=METHOD, assistant_model=assistant, num_speculative_tokens=3,
                          tree_width=width, speculative_sampling="rejection", seed=3, return_dict_in_generate=True)
    assert out.sequences.shape == (3, 22) and out.speculative_stats["sampling"] == "rejection"
    assert out.speculative_stats["accepted_drafts"] > 0


# ------------------------------------------------------------------------------------------------ options, errors
def test_draft_length_default_from_the_assistant(pair):
    target, assistant = pair
    opts = dict(drafter=assistant, num_speculative_tokens=None, tree_width=1, draft_length_schedule="adaptive")
    assert _build(target, opts).num_tokens is None
    assistant.generation_config.num_assistant_tokens = 5
    try:
        assert _build(target, opts).num_tokens == 5
        assert _build(target, {**opts, "num_speculative_tokens": 2}).num_tokens == 2
    finally:
        assistant.generation_config.num_assistant_tokens = None


def test_wrong_target_family_is_refused(pair):
    _, assistant = pair
    llama = tiny_model("llama", hidden=H)
    ids, _ = prompts(1, length=8)
    with pytest.raises(ValueError, match="Gemma 4 or Gemma 3n target.*LlamaForCausalLM"):
        llama.generate(input_ids=ids, max_new_tokens=4, custom_generate=METHOD, assistant_model=assistant, **GREEDY)


def test_kv_geometry_mismatch_is_refused(pair):
    target, _ = pair
    other = _assistant(_gemma3n_target(), oracle=False)  # head dim 8 for full attention; this target's is 16
    with pytest.raises(ValueError, match="full_attention layers attend with .* = \\(2, 8\\).*has \\(2, 16\\)"):
        check_pair(target, other)


def test_hidden_size_mismatch_is_refused(pair):
    target, _ = pair
    other = _assistant(target, oracle=False)
    other.config.backbone_hidden_size = 48
    with pytest.raises(ValueError, match="hidden size 48.*hidden_size=32"):
        check_pair(target, other)
    ids, _ = prompts(1, length=8)
    with pytest.raises(ValueError, match="backbone_hidden_size"):
        target.generate(input_ids=ids, max_new_tokens=4, custom_generate=METHOD, assistant_model=other, **GREEDY)


@pytest.mark.parametrize("bsz", [1, 3])
def test_auto_runs_a_gemma4_assistant(pair, bsz):
    """The transformers user's call plus custom_generate='hf_specdec/auto': the assistant's kind selects this method,
    its num_assistant_tokens is read as transformers reads it; same text as transformers' own run (batch 1) and as
    plain greedy decoding (padded batch 3, which transformers' assisted decoding refuses)."""
    target, assistant = pair
    ids, mask = prompts(bsz, length=12)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=16, **GREEDY)
    ref = target.generate(**kw)
    assistant.generation_config.num_assistant_tokens = 3
    try:
        if bsz == 1:
            assert torch.equal(target.generate(**kw, assistant_model=assistant), ref)
        ours = target.generate(**kw, assistant_model=assistant, custom_generate=hf_specdec.custom_generate_path("auto"),
                               trust_remote_code=True, return_dict_in_generate=True)
    finally:
        assistant.generation_config.num_assistant_tokens = None
    assert torch.equal(ours.sequences, ref)
    assert ours.speculative_stats["method"] == "gemma4_assistant"


# ---------------------------------------------------------------------------------------------------------- bf16
def test_generates_on_a_bfloat16_target(tmp_path):
    """Greedy generate() on a bf16 Gemma 4 target, one row and a left-padded batch of two, the assistant (saved in
    float32) loaded in the target's dtype, as tests/test_dtypes.py does for the other methods: drafts are made and
    verified in bf16; outputs equal plain decoding only up to rounding, so they are not compared."""
    from hf_specdec import registry

    target = _gemma4_target()
    _assistant(target).save_pretrained(tmp_path / "assistant")
    target = target.to(torch.bfloat16)
    assistant = registry.load_drafter("gemma4_assistant", str(tmp_path / "assistant"), target)
    assert {p.dtype for p in assistant.parameters() if p.is_floating_point()} == {torch.bfloat16}
    for batch in (1, 2):
        ids, mask = prompts(batch, 12)
        out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, custom_generate=METHOD,
                              assistant_model=assistant, num_speculative_tokens=3, return_dict_in_generate=True,
                              **GREEDY)  # on one thread (the module's fixture): bf16 at tiny shapes
        assert out.sequences.shape == (batch, ids.shape[1] + 8) and out.sequences.dtype == torch.long
        assert out.speculative_stats["proposed_drafts"] > 0
