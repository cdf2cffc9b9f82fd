"""hf_specdec inside a text-generation pipeline, with a padded batch.

    python examples/pipeline_batch.py
"""
from transformers import pipeline

import hf_specdec
from hf_specdec.default_model import load_smollm2

model, tok = load_smollm2()
pipe = pipeline("text-generation", model=model, tokenizer=tok)
chats = [
    [{"role": "user", "content": "Repeat exactly: red, green, blue, red, green, blue."}],
    [{"role": "user", "content": "Name a planet."}],
]
outs = pipe(chats, batch_size=2, max_new_tokens=32, do_sample=False,
            custom_generate=hf_specdec.custom_generate_path("prompt_lookup"), trust_remote_code=True)
for o in outs:
    print(o[0]["generated_text"][-1]["content"])
