"""A speculative decoding method of your own: a proposer and one registry record, nothing else.

Once registered, the method runs through every entry point: ``decoding_method``, the ``custom_generate`` folder
(written for it under $HF_SPECDEC_CACHE), ``pipeline()``, ``hf-specdec bench`` and ``hf-specdec generate``.

    python examples/custom_method.py
"""
import torch

import hf_specdec
from hf_specdec import Method, Option, register
from hf_specdec.default_model import load_smollm2
from hf_specdec.proposers import Proposer
from hf_specdec.tree import DraftTree


class CopyWindow(Proposer):
    """Drafts the ``width`` tokens that followed the previous occurrence of the last token (a one-gram lookup)."""

    name = "copy_window"

    def __init__(self, width: int):
        self.width = width
        self.max_nodes = width + 1  # the most tree nodes per row, root included

    def propose(self, state):
        drafts = torch.zeros(state.batch_size, self.width, dtype=torch.long)
        counts = torch.zeros(state.batch_size, dtype=torch.long)
        for b in range(state.batch_size):
            seq = state.row_tokens(b)  # committed tokens of row b, the root last
            hits = (seq[:-1] == seq[-1]).nonzero()
            if hits.numel():
                cont = seq[int(hits[-1]) + 1:][: min(self.width, state.max_drafts[b])]
                drafts[b, : cont.numel()] = cont
                counts[b] = cont.numel()
        if not counts.any():
            return None  # a plain decoding step
        return DraftTree.chain(state.roots(), drafts, counts)


register(Method(
    name="copy_window",
    summary="the tokens after the previous occurrence of the last token",
    build=lambda target, opts: CopyWindow(opts["width"]),
    options=(Option("width", int, 4, "drafts per step"),),
))

model, tok = load_smollm2()
chat = [{"role": "user", "content": "Repeat exactly: one two three four, one two three four, one two three four."}]
inputs = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
plain = model.generate(**inputs, max_new_tokens=48, do_sample=False)
out = model.generate(**inputs, max_new_tokens=48, do_sample=False, return_dict_in_generate=True, width=6,
                     custom_generate=hf_specdec.custom_generate_path("copy_window"), trust_remote_code=True)
print(tok.decode(out.sequences[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
print(f"identical to plain greedy: {torch.equal(out.sequences, plain)}, "
      f"acceptance length {out.speculative_stats['acceptance_length']:.2f}")
