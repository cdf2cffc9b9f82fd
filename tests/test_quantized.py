"""Quantized targets and drafters (docs/quantization.md): every method gives the quantized target's own greedy output.

Targets are a tiny Llama saved to a folder and loaded back through ``from_pretrained(..., quantization_config=...)``
(transformers' own quantizers, the path users take), with the configs of :data:`hf_specdec.quantization.QUANTIZATIONS`;
drafters are the tests' tiny ones (:func:`tiny.tiny_drafter`) loaded from folders by ``registry.load_drafter``, bound
to the quantized target. Coverage, kept to about a minute on 2 cores: every method on torchao int8 (the setup of issue
50), one row and a left-padded batch of three; a representative set on the other backends (prompt_lookup: the CPU
kernel path's default; assisted: a draft model; eagle3: a drafter reading the target's LM head and features). A
backend whose package is absent is skipped.

Also: which runner a quantized target gets (the model's own forward, said once), LLM.int8()'s outlier columns (a
token computed by its neighbours' outliers, said once; not with ``llm_int8_threshold=0.0``), quantized drafters (a
draft model and an EAGLE-3 drafter quantized with torchao's ``quantize_`` or quanto's, LM heads included) under the
CPU kernel runner of a dense target, the values read from quantized layers, and ``hf-specdec bench --quantize``.
"""

import json
import logging

import pytest
import torch

import hf_specdec
from hf_specdec import quantization, registry
from hf_specdec.kernels import CpuKernelRunner, plain_cpu_linears
from hf_specdec.runner_choice import runner_for
from hf_specdec.runners import TargetRunner
from tiny import OWN_TARGETS, prompts, tiny_drafter, tiny_model, word_tokenizer

HIDDEN = 64  # bitsandbytes' 4-bit blocks are 64 wide
LAYERS = 3
NEW = 12
PACKAGES = {"torchao": "torchao", "quanto": "optimum.quanto", "bnb": "bitsandbytes"}
METHODS = [m.name for m in registry.methods() if m.name not in OWN_TARGETS]
REPRESENTATIVE = ["prompt_lookup", "assisted", "eagle3"]
CASES = [("torchao-int8", m) for m in METHODS] + [
    (q, m) for q in quantization.QUANTIZATIONS if q != "torchao-int8" for m in REPRESENTATIVE]


def _needs(quant: str) -> None:
    pytest.importorskip(PACKAGES[quant.partition("-")[0]])


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The dense target's folder and, per method with a drafter, a folder of its tiny drafter."""
    root = tmp_path_factory.mktemp("quantized")
    target = tiny_model("llama", layers=LAYERS, hidden=HIDDEN)
    target.save_pretrained(root / "target")
    out = {"target": str(root / "target")}
    for m in registry.methods():
        if m.drafter is not None and m.name not in OWN_TARGETS:
            tiny_drafter(m.name, target).save_pretrained(root / m.name)
            out[m.name] = str(root / m.name)
    return out


_TARGETS = {}


def quantized_target(folders, quant: str):
    """The tiny target loaded with the quantization ``quant`` (one per module run)."""
    if quant not in _TARGETS:
        from transformers import AutoModelForCausalLM

        _TARGETS[quant] = AutoModelForCausalLM.from_pretrained(
            folders["target"], quantization_config=quantization.quantization_config(quant)).eval()
    return _TARGETS[quant]


def _same_as_own_greedy(target, opts, method="prompt_lookup"):
    for batch in (1, 3):
        ids, mask = prompts(batch, 12, seed=batch)
        kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
        ref = target.generate(**kw)
        out = target.generate(**kw, custom_generate=hf_specdec.decoding_method(method, **opts))
        assert torch.equal(out, ref), (method, batch)


@pytest.mark.parametrize("quant, method", CASES)
def test_every_method_gives_the_quantized_targets_own_greedy_output(folders, quant, method):
    _needs(quant)
    target = quantized_target(folders, quant)
    assert quantization.not_dense(target) is not None
    opts = {"drafter": registry.load_drafter(method, folders[method], target)} if method in folders else {}
    _same_as_own_greedy(target, opts, method)


def test_a_quantized_target_keeps_its_own_forward_said_once(folders, caplog):
    """The issue's failure: torchao's Int8Tensor has no ``aten.mm``, so the kernel runner's products cannot take it;
    the runner choice gives the model's own forward, with one log line per model naming why."""
    _needs("torchao-int8")
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(folders["target"],
                                                  quantization_config=quantization.quantization_config("torchao-int8"))
    with caplog.at_level(logging.WARNING, logger="hf_specdec"):
        assert type(runner_for(target)) is TargetRunner and type(runner_for(target)) is TargetRunner
        _same_as_own_greedy(target, {})
    said = [r.getMessage() for r in caplog.records if "own forward" in r.getMessage()]
    assert len(said) == 1 and "it is quantized (torchao; its model.layers.0.self_attn.q_proj.weight is a torchao " \
                               "Int8Tensor)" in said[0], said
    assert plain_cpu_linears(target) == [target.lm_head]  # the head transformers leaves unquantized: dense
    dense = tiny_model("llama", layers=LAYERS, hidden=HIDDEN)
    assert isinstance(runner_for(dense), CpuKernelRunner) and quantization.not_dense(dense) is None


def test_bitsandbytes_int8_outlier_columns_are_said(folders, caplog):
    """LLM.int8() with its default threshold computes the input columns where any row of a forward has an outlier in
    float16: a row's output depends on the other rows (so a verification may round a token otherwise than its
    one-token step), said once per model; ``llm_int8_threshold=0.0`` computes each row on its own."""
    _needs("bnb-int8")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    def load(**kw):
        return AutoModelForCausalLM.from_pretrained(folders["target"], quantization_config=BitsAndBytesConfig(
            load_in_8bit=True, **kw))

    default, zero = load(), load(llm_int8_threshold=0.0)
    with caplog.at_level(logging.WARNING, logger="hf_specdec"):
        runner_for(default), runner_for(default), runner_for(zero)
    said = [r.getMessage() for r in caplog.records if "LLM.int8()" in r.getMessage()]
    assert len(said) == 1 and "llm_int8_threshold=6.0" in said[0] and "llm_int8_threshold=0.0" in said[0], said
    assert quantization.rows_interact(zero) is None
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(0))
    x[1, 5] = 20.0  # an outlier in another row
    for model, independent in ((default, False), (zero, True)):
        layer = model.model.layers[0].self_attn.q_proj
        with torch.no_grad():
            assert torch.equal(layer(x[:1]), layer(x)[:1]) is independent
    _same_as_own_greedy(zero, {})


def test_torchao_quantize_without_transformers_is_found_by_its_weights(folders):
    """torchao's own ``quantize_`` (no quantization_config in the config, the LM head quantized too): found by the
    weights' type; the drafters read the quantized head's values (eagle3: its rows; the draft model with a draft
    vocabulary: its own quantized head), and the outputs stay the target's own."""
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    target = tiny_model("llama", layers=LAYERS, hidden=HIDDEN)
    quantize_(target, Int8WeightOnlyConfig())
    assert quantization.not_dense(target) == "its model.layers.0.self_attn.q_proj.weight is a torchao Int8Tensor"
    assert type(target.lm_head.weight).__name__ == "Int8Tensor"
    assert type(runner_for(target)) is TargetRunner
    _same_as_own_greedy(target, {"drafter": registry.load_drafter("eagle3", folders["eagle3"], target)}, "eagle3")
    drafter = tiny_drafter("assisted", target)
    quantize_(drafter, Int8WeightOnlyConfig())
    _same_as_own_greedy(target, {"drafter": drafter, "draft_vocab": list(range(0, 96, 2))}, "assisted")


@pytest.mark.parametrize("quant", ["torchao-int8", "quanto-int8"])
def test_quantized_drafters_with_a_dense_target(folders, quant):
    """A dense target runs the CPU kernel runner, which gives drafters its faster product: a quantized drafter's
    layers keep their own forward (the issue's NotImplementedError otherwise), its dense ones take the product. A
    draft model (with and without a draft vocabulary, read from its quantized head) and an EAGLE-3 drafter."""
    _needs(quant)
    target = tiny_model("llama", layers=LAYERS, hidden=HIDDEN)
    assert isinstance(runner_for(target), CpuKernelRunner)
    drafter = _quantized_module(tiny_drafter("assisted", target), quant)
    assert quantization.not_dense(drafter) is not None
    assert drafter.lm_head not in plain_cpu_linears(drafter)
    _same_as_own_greedy(target, {"drafter": drafter, "num_speculative_tokens": 3}, "assisted")
    _same_as_own_greedy(target, {"drafter": drafter, "draft_vocab": list(range(0, 96, 2))}, "assisted")
    eagle = _quantized_module(registry.load_drafter("eagle3", folders["eagle3"], target), quant)
    _same_as_own_greedy(target, {"drafter": eagle}, "eagle3")


def _quantized_module(module, quant: str):
    """``module`` with every linear layer quantized in place by the backend's own API (LM heads included)."""
    if quant == "torchao-int8":
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        quantize_(module, Int8WeightOnlyConfig())
    else:
        from optimum.quanto import freeze, qint8, quantize

        quantize(module, weights=qint8)
        freeze(module)
    return module


@pytest.mark.parametrize("quant", list(quantization.QUANTIZATIONS))
def test_dense_weight_reads_a_quantized_layer(folders, quant):
    """:func:`~hf_specdec.quantization.dense_weight` of a quantized linear layer: the weight the layer multiplies by
    (``F.linear`` with it gives the layer's output), close to the dense weight it was quantized from."""
    _needs(quant)
    target = quantized_target(folders, quant)
    dense = tiny_model("llama", layers=LAYERS, hidden=HIDDEN)
    layer, original = target.model.layers[1].mlp.down_proj, dense.model.layers[1].mlp.down_proj.weight
    weight = quantization.dense_weight(layer)
    assert type(weight) is torch.Tensor and weight.shape == original.shape and weight.dtype == torch.float32
    x = torch.randn(5, layer.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(torch.nn.functional.linear(x, weight), layer(x).float(), rtol=0.02, atol=0.05)
    assert (weight - original).abs().max() < 0.25 * original.abs().max()  # int4 / nf4: coarse, still the same weight
    assert quantization.dense_weight(target.lm_head) is target.lm_head.weight  # plain: the tensor itself


def test_quantization_names_and_errors(monkeypatch):
    with pytest.raises(ValueError, match="Unknown quantization 'int3': the quantizations are torchao-int8, "):
        quantization.quantization_config("int3")
    import builtins

    real = builtins.__import__

    def no_torchao(name, *args, **kwargs):
        if name.startswith("torchao"):
            raise ImportError("No module named 'torchao'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torchao)
    with pytest.raises(ImportError, match="The quantization 'torchao-int8' needs the package 'torchao': pip install"):
        quantization.quantization_config("torchao-int8")
    odd = torch.nn.LayerNorm(2)  # a quantized weight of a layer that is neither linear nor an embedding
    odd.weight = torch.nn.Parameter(torch.ones(2).as_subclass(_Sub))
    with pytest.raises(ValueError, match="LayerNorm.weight is a test_quantized _Sub that the library cannot read as "
                                         "plain values .* Load the model with this layer unquantized"):
        quantization.dense_weight(odd)


class _Sub(torch.Tensor):
    """A tensor subclass (as quantized weights are)."""


def test_cli_bench_quantize(tmp_path, monkeypatch):
    """``hf-specdec bench --quantize torchao-int8``: the target loads quantized (through from_pretrained's
    quantization_config), the same target unquantized in float32 runs stock generate() as 'plain_fp32', the JSON
    records the quantization, the table says it, and the outputs are compared with the quantized target's own (no
    mismatch: exit status 0). Plumbing only: nothing is timed."""
    pytest.importorskip("torchao")
    from hf_specdec import cli
    from hf_specdec.bench import run as bench_run

    tiny_model("llama", layers=LAYERS, hidden=HIDDEN).save_pretrained(tmp_path / "m")
    tok = word_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'][:40] }}{% endfor %}"
    tok.save_pretrained(tmp_path / "m")
    seen = []
    monkeypatch.setattr("hf_specdec.bench.run_bench", lambda model, tok, methods, *a, **kw: seen.append(
        (quantization.not_dense(model), [(m.name, m.model) for m in methods])) or bench_run.run_bench(
            model, tok, methods, *a, **kw, curve_sizes=[1, 2], count_syncs=False))  # less to run: nothing is timed
    out = tmp_path / "out"
    assert cli.main(["bench", "--target", str(tmp_path / "m"), "--quantize", "torchao-int8", "--methods",
                     "prompt_lookup", "--datasets", "gsm8k", "--limit", "1", "--max-new-tokens", "4",
                     "--out", str(out)]) == 0
    (reason, methods), = seen
    assert reason.startswith("it is quantized (torchao")
    fp32 = dict(methods)["plain_fp32"]
    assert fp32.dtype == torch.float32 and quantization.not_dense(fp32) is None
    saved = json.loads((out / "bench.json").read_text())
    assert saved["config"]["quantize"] == "torchao-int8"
    assert {r["method"] for r in saved["summary"]} == {"plain", "prompt_lookup", "plain_fp32"}
    assert all(r["mismatches"] == 0 and "speedup_vs_fp32" in r for r in saved["summary"])
    assert "Quantized target (torchao-int8)" in (out / "bench.md").read_text()
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", "--quantize", "int3"])
