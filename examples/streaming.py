"""Streaming with a speculative method: accepted tokens are printed as they are verified.

    python examples/streaming.py
"""
from transformers import TextStreamer

from hf_specdec.default_model import load_smollm2
import hf_specdec

model, tok = load_smollm2()
chat = [{"role": "user", "content": "Write a haiku about the sea, then repeat it."}]
inputs = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
model.generate(**inputs, max_new_tokens=80, do_sample=True, temperature=0.7,
               streamer=TextStreamer(tok, skip_prompt=True, skip_special_tokens=True),
               custom_generate=hf_specdec.custom_generate_path("prompt_lookup"), trust_remote_code=True)
