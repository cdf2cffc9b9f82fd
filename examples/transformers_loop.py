"""hf_specdec's proposers as transformers CandidateGenerators, run inside transformers' own assisted loop.

    python examples/transformers_loop.py
"""
from hf_specdec.candidate_generators import in_transformers_loop
from hf_specdec.default_model import load_smollm2

model, tok = load_smollm2()
chat = [{"role": "user", "content": "Repeat exactly: one two three four five, one two three four five."}]
inputs = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
plain = model.generate(**inputs, max_new_tokens=32, do_sample=False)
out = model.generate(**inputs, max_new_tokens=32, do_sample=False, custom_generate=in_transformers_loop("prompt_lookup"))
print(tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
print("identical:", bool((out == plain).all()))

# Or build the generator yourself, e.g. in a subclass's _get_candidate_generator():
#   from hf_specdec.candidate_generators import PromptLookupCandidateGenerator
#   gen = PromptLookupCandidateGenerator(model, num_output_tokens=10, logits_processor=processors, max_length=256)
