"""Medusa against the peer's own code: FasterDecoding's ``medusa-llm==0.1`` wheel (PyPI), imported at test time.

The wheel is fetched by the test (``pip download --no-deps``, or a wheel already in ``$HF_SPECDEC_PEER_WHEELS``)
and unpacked in a temporary folder; nothing of it is copied into this repository, and its dependencies (fschat,
...) are not installed. Without a network and without a local wheel the tests skip.

* ``medusa/model/utils.py`` (buffers, candidates, tree decoding, posterior) imports only torch: loaded as is.
* ``medusa/model/medusa_model.py`` (``ResBlock``, ``MedusaModel``) imports ``.modeling_llama_kv`` (transformers-4
  internals) and ``.kv_cache``: it is loaded inside a synthetic package in which those two are stubs, so its real
  head construction (``nn.Sequential(*([ResBlock(H)] * L), nn.Linear(H, V, bias=False))``, one block object
  repeated ``L`` times) and its forward are what run.

Version 0.1's tree is the *cartesian* form: ``medusa_choices = [1, k_1, ..., k_K]`` (the root, then head ``i``'s
top ``k_i``, every combination), and ``generate_candidates`` takes ``medusa_topk = medusa_choices[1:]`` (as its
``medusa_generate`` passes it). The path lists (``mc_sim_7b_63``) came with later releases, which PyPI does not
have; here the 63-node tree is the cartesian ``[1, 3, 2, 3, 2]`` (depth 4, 63 drafts) written as paths for us.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

import hf_specdec
from hf_specdec import engine as engine_mod
from hf_specdec.conversions.medusa import convert_medusa
from hf_specdec.proposers.medusa import MC_SIM_7B_63, check_choices
from hf_specdec.verify import accept
from medusa_fixtures import H, V, medusa_files, random_heads
from tiny import prompts, tiny_model, word_tokenizer

PEER = "medusa-llm==0.1"
WHEEL_GLOB = "medusa_llm-0.1-*.whl"
PKG = "_hf_specdec_peer_medusa"  # the synthetic package the peer's model files are loaded into
TREES = {"cartesian_63": [1, 3, 2, 3, 2], "peer_default": [1, 7, 6]}  # 63 drafts depth 4; medusa_generate's default
K = 4  # heads: the deepest tree has depth 4


# ------------------------------------------------------------------------------------------------- the peer's code
def _wheel(tmp: Path) -> Path:
    for folder in filter(None, os.environ.get("HF_SPECDEC_PEER_WHEELS", "").split(os.pathsep)):
        found = sorted(Path(folder).glob(WHEEL_GLOB))
        if found:
            return found[-1]
    cmd = [sys.executable, "-m", "pip", "download", PEER, "--no-deps", "--only-binary=:all:", "--no-input",
           "--disable-pip-version-check", "-d", str(tmp)]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as err:
        pytest.skip(f"could not download the peer wheel {PEER} ({type(err).__name__}: {err}); set "
                    "HF_SPECDEC_PEER_WHEELS to a folder holding it to run these tests offline")
    found = sorted(tmp.glob(WHEEL_GLOB))
    if run.returncode != 0 or not found:
        tail = (run.stderr or run.stdout).strip().splitlines()[-3:]
        pytest.skip(f"could not download the peer wheel {PEER} (pip exit {run.returncode}: {' | '.join(tail)}); "
                    "set HF_SPECDEC_PEER_WHEELS to a folder holding it to run these tests offline")
    return found[-1]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class _StubLlama:
    """Stands for the peer's ``modeling_llama_kv.LlamaForCausalLM`` (only ``from_pretrained`` would use it)."""


def _no_kv_cache(*args, **kwargs):
    raise NotImplementedError("stub: the peer's KV cache is not part of these comparisons")


@pytest.fixture(scope="module")
def peer(tmp_path_factory):
    """``SimpleNamespace(utils=<medusa/model/utils.py>, model=<medusa/model/medusa_model.py>)`` from the wheel."""
    tmp = tmp_path_factory.mktemp("peer")
    with zipfile.ZipFile(_wheel(tmp)) as zf:
        zf.extractall(tmp / "unpacked")
    folder = tmp / "unpacked" / "medusa" / "model"
    names = [PKG, f"{PKG}.modeling_llama_kv", f"{PKG}.kv_cache", f"{PKG}.utils", f"{PKG}.medusa_model"]
    assert not any(n in sys.modules for n in names)
    pkg = types.ModuleType(PKG)
    pkg.__path__ = [str(folder)]
    llama_kv = types.ModuleType(names[1])
    llama_kv.LlamaForCausalLM = _StubLlama
    kv_cache = types.ModuleType(names[2])
    kv_cache.initialize_past_key_values = _no_kv_cache
    sys.modules.update(dict(zip(names[:3], (pkg, llama_kv, kv_cache))))
    try:
        utils = _load(names[3], folder / "utils.py")
        model = _load(names[4], folder / "medusa_model.py")
        yield types.SimpleNamespace(utils=utils, model=model)
    finally:
        for n in names:
            sys.modules.pop(n, None)


class _FakeBase(nn.Module):
    """What ``MedusaModel`` reads from its base model: ``config``, ``lm_head``, ``dtype``, ``device``, and
    ``model(...)[0]`` (the final hidden state) in its forward. The hidden state is passed in as ``input_ids``."""

    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(hidden_size=H, vocab_size=V)
        self.lm_head = nn.Linear(H, V, bias=False)
        self.model = _Identity()

    @property
    def dtype(self):
        return self.lm_head.weight.dtype

    @property
    def device(self):
        return self.lm_head.weight.device


class _Identity(nn.Module):
    def forward(self, input_ids=None, **kwargs):
        return (input_ids,)


def _checkpoint(tmp: Path, heads) -> Path:
    """A FasterDecoding heads-only checkpoint (bf16 ``medusa_lm_head.pt`` + its config) in ``tmp``."""
    tmp.mkdir(parents=True)
    for name, data in medusa_files(heads, fmt="pt", config_heads=len(heads)).items():
        (tmp / name).write_bytes(data)
    return tmp


# ------------------------------------------------------------------------------------------------------ 1. heads
@pytest.mark.parametrize("layers", [1, 3])
def test_heads_equal_the_peers_medusa_head(peer, tmp_path, layers):
    heads = random_heads(num_heads=K, layers=layers, seed=layers)  # every block different
    folder = _checkpoint(tmp_path / "ckpt", heads)
    word_tokenizer().save_pretrained(tmp_path / "tok")  # MedusaModel.__init__ loads a tokenizer
    theirs = peer.model.MedusaModel(_FakeBase(), medusa_num_heads=K, medusa_num_layers=layers,
                                    base_model_name_or_path=str(tmp_path / "tok"))
    state = torch.load(folder / "medusa_lm_head.pt", map_location="cpu")  # as MedusaModel.from_pretrained does
    missing, unexpected = theirs.medusa_head.load_state_dict(state, strict=False)
    assert not missing and not unexpected
    assert all(theirs.medusa_head[i][0] is theirs.medusa_head[i][layers - 1] for i in range(K))  # [ResBlock] * L
    ours = convert_medusa(folder, dtype=torch.float32)
    assert ours.config.shared_layers == (layers > 1)
    hidden = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = theirs(input_ids=hidden)  # [K, B, T, V]
        got = ours(hidden)  # [B, T, K, V]
    torch.testing.assert_close(got, expected.permute(1, 2, 0, 3), atol=1e-5, rtol=1e-5)
    # with L > 1 the peer runs head i's last block L times: the last j's weights win
    w_last = heads[0][0][-1][0].to(torch.bfloat16).float()
    assert torch.equal(theirs.medusa_head[0][0].linear.weight, w_last)


# ------------------------------------------------------------------------------------------------------- 2. tree
def _paths(choices: list[int]) -> list[tuple[int, ...]]:
    """The cartesian tree ``[1, k_1, ..., k_D]`` as our choices: every prefix of ``range(k_1) x ... x range(k_D)``."""
    ranges = [range(k) for k in choices[1:]]
    return [p for d in range(1, len(ranges) + 1) for p in itertools.product(*ranges[:d])]


def _peer_node_paths(choices: list[int], buffers) -> list[tuple[int, ...]]:
    """Each non-root node of the peer's tree as a path of top-k ranks, read from its buffers: node ``n`` holds
    ``candidates_flat[tree_indices[n]]`` (root, then head 0's top ``k_1``, head 1's top ``k_2``, ...) and attends to
    its ancestors (``medusa_attn_mask``, rows in level order)."""
    starts = torch.cumsum(torch.tensor(choices), 0).tolist()  # flat index of head d's first candidate: starts[d]

    def rank(flat):
        depth = next(d for d in range(len(starts)) if flat < starts[d])
        return flat - starts[depth - 1]

    mask = buffers["medusa_attn_mask"][0, 0]
    flat = buffers["tree_indices"].tolist()
    return [tuple(rank(flat[a]) for a in mask[n].nonzero()[:, 0].tolist() if a) for n in range(1, mask.shape[0])]


@pytest.fixture(scope="module", params=list(TREES))
def scene(request, peer, tmp_path_factory):
    """One greedy Medusa step of ours over a cartesian tree, with the verified tree captured, and the peer's buffers
    and candidates for the same choices and the same head logits."""
    choices = TREES[request.param]
    tmp = tmp_path_factory.mktemp("scene")
    heads = convert_medusa(_checkpoint(tmp / "ckpt", random_heads(num_heads=K, seed=11)), dtype=torch.float32)
    target = tiny_model("llama", layers=2, hidden=H)
    ids, mask = prompts(1, 12)
    seen = []

    def spy(tree, *args, **kwargs):
        seen.append(tree)
        return accept(tree, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_mod, "accept", spy)
        target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None,
                        custom_generate=hf_specdec.decoding_method("medusa"), drafter=heads,
                        medusa_choices=[list(p) for p in _paths(choices)], draft_length_schedule="constant")
    with torch.no_grad():
        out = target(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        medusa_logits = heads(out.hidden_states[-1][:, -1:])  # [1, 1, K, V]
    buffers = peer.utils.generate_medusa_buffers(choices, device="cpu")
    candidates, tree_candidates = peer.utils.generate_candidates(
        # [D, 1, 1, V]: the peer's [heads, batch, positions, vocab]; it reads every head it is given, so only the
        # tree's D = len(choices) - 1 (its medusa_generate needs medusa_num_heads == D)
        medusa_logits[:, :, :len(choices) - 1].permute(2, 0, 1, 3),
        out.logits[:, -1:],  # [1, 1, V]
        choices[1:],  # medusa_topk, as medusa_generate passes it
        buffers["tree_indices"], 0)
    return types.SimpleNamespace(choices=choices, tree=seen[0], buffers=buffers, candidates=candidates,
                                 tree_candidates=tree_candidates)


def test_mc_sim_7b_63_paths_are_not_a_peer_0_1_tree(peer):
    with pytest.raises((ValueError, TypeError)):  # 0.1 takes per-head counts; ragged paths make no tensor
        peer.utils.generate_medusa_buffers([list(c) for c in MC_SIM_7B_63], device="cpu")


def test_tree_equals_the_peers_buffers_and_candidates(scene):
    paths = _paths(scene.choices)
    n = 1 + len(paths)
    assert check_choices(paths, K) == _peer_node_paths(scene.choices, scene.buffers)  # same node order
    tree = scene.tree
    assert tree.tokens.shape == (1, n) and bool(tree.valid.all())
    assert scene.buffers["medusa_attn_mask"].shape == (1, 1, n, n)
    assert torch.equal(tree.ancestors[0], scene.buffers["medusa_attn_mask"][0, 0].bool())
    assert torch.equal(tree.depths[0], scene.buffers["medusa_position_ids"])
    assert torch.equal(tree.tokens[0], scene.tree_candidates[0])
    # the peer's cartesian candidates are our root-to-leaf paths, gathered along its retrieve_indices
    assert torch.equal(scene.candidates, tree.tokens[0][scene.buffers["retrieve_indices"]])


# ------------------------------------------------------------------------------------------------- 3. acceptance
def _tree_logits(tree, seed: int) -> torch.Tensor:
    """``[1, N, V]`` random logits (a scale of 2..4 per node) with a random boost (0..6) on each node's children:
    some drafts win, some lose."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, tree.num_nodes, V, generator=g) * (2 + 2 * torch.rand(1, tree.num_nodes, 1, generator=g))
    tokens = tree.tokens[0]
    for node, kids in enumerate(tree.children(0)):
        for c in kids:
            logits[0, node, tokens[c]] += 6 * torch.rand((), generator=g)
    return logits


def _peer_choice(peer, scene, logits, temperature, threshold=0.09, alpha=0.3):
    """The peer's accepted nodes (root first) and its next token's logits (its ``evaluate_posterior`` on the logits
    its ``tree_decoding`` gathers along ``retrieve_indices``)."""
    retrieve = scene.buffers["retrieve_indices"]

    def model(tree_candidates, output_orig, past_key_values, position_ids):  # the target's tree forward: `logits`
        return logits.new_zeros(K, 1, logits.shape[1], 1), None, logits

    _, path_logits, _ = peer.utils.tree_decoding(model, scene.tree_candidates, None,
                                                 scene.buffers["medusa_position_ids"], scene.tree.tokens[:, :1],
                                                 retrieve)
    best, length = peer.utils.evaluate_posterior(path_logits, scene.candidates, temperature, threshold, alpha)
    best, length = int(best), int(length)
    return retrieve[best, :length + 1].tolist(), scene.candidates[best, 1:length + 1].tolist(), \
        path_logits[best, length]


SEEDS = range(24)


def test_greedy_acceptance_equals_the_peers(peer, scene):
    tree, lengths = scene.tree, set()
    for seed in SEEDS:
        logits = _tree_logits(tree, seed)
        nodes, tokens, next_logits = _peer_choice(peer, scene, logits, temperature=0)
        ours = accept(tree, logits, [tree.tokens[0, :1]], [True], None, False)
        assert ours.paths[0] == nodes, seed
        assert ours.new_tokens[0] == tokens + [int(next_logits.argmax())], seed  # the peer's next root: argmax
        lengths.add(len(tokens))
    assert 0 in lengths and max(lengths) >= 2, lengths


@pytest.mark.parametrize("threshold,alpha", [(0.09, 0.3), (0.3, 0.5), (0.01, 0.1)])
def test_typical_acceptance_equals_the_peers(peer, scene, threshold, alpha):
    """(0.09, 0.3): the peer's defaults; (0.3, 0.5) is a higher bar (fewer accepted), (0.01, 0.1) a lower one."""
    tree, lengths = scene.tree, []
    for seed in SEEDS:
        logits = _tree_logits(tree, seed)
        nodes, tokens, _ = _peer_choice(peer, scene, logits, 1.0, threshold, alpha)
        torch.manual_seed(seed)  # our rule samples the next token; the peer's 0.1 takes the argmax next step
        ours = accept(tree, logits, [tree.tokens[0, :1]], [True], None, True, typical=(threshold, alpha))
        assert ours.paths[0] == nodes, seed
        assert ours.new_tokens[0][:-1] == tokens, seed
        lengths.append(len(tokens))
    assert 0 in lengths and max(lengths) >= 1, lengths  # whole trees rejected, and drafts accepted
