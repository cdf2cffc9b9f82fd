"""``transformers serve`` (transformers' OpenAI-compatible server) on a model folder with a method attached
(``hf-specdec attach``), as a real server process (:class:`hf_specdec.bench.served.TransformersServer`): it loads the
folder with ``--trust-remote-code``, and every chat completion — plain, streamed, four at once — is decoded by the
attached method with plain greedy decoding's text.

Needs the serving extras (``pip install -e ".[serve]"``; ``.[test]`` includes them); skipped without them. One
server for the module: about 11 s to start on 2 cores, the requests under a second each.
"""

import re
import threading

import pytest
import torch

pytest.importorskip("fastapi", reason='transformers serve needs its extras: pip install -e ".[serve]"')
pytest.importorskip("uvicorn", reason='transformers serve needs its extras: pip install -e ".[serve]"')

import hf_specdec  # noqa: E402
from hf_specdec.bench.served import TransformersServer  # noqa: E402
from tiny import chat_tokenizer, tiny_drafter, tiny_model  # noqa: E402

MAX_TOKENS = 12
CHATS = [[{"role": "user", "content": "abcabcabcabc"}], [{"role": "user", "content": "hello hello hello"}],
         [{"role": "system", "content": "be brief"}, {"role": "user", "content": "xyzxyzxyz"}],
         [{"role": "user", "content": "the cat sat on the mat, the cat sat"}]]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    folder = root / "model"
    target = tiny_model("llama")
    target.generation_config.eos_token_id = None  # every answer runs to max_tokens
    target.save_pretrained(folder)
    chat_tokenizer().save_pretrained(folder)
    tiny_drafter("assisted", target).save_pretrained(root / "draft")
    hf_specdec.attach(folder, "assisted", drafter=root / "draft", num_speculative_tokens=3)
    env = {"HF_HUB_OFFLINE": "1", "HF_SPECDEC_LOG_CALLS": "1", "HF_MODULES_CACHE": str(root / "modules")}
    with TransformersServer(folder, trust_remote_code=True, env=env, log=root / "server.log") as running:
        yield running


def _reference(folder) -> list[str]:
    """Plain greedy decoding of each chat: the folder loaded without trust_remote_code (transformers' generate)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    texts = []
    for chat in CHATS:
        inputs = tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=True, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS)
        texts.append(tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
    return texts


def test_chat_completions_plain_streamed_and_concurrent(server):
    reference = _reference(server.folder)
    answer = server.complete(CHATS[0], MAX_TOKENS)
    assert answer["choices"][0]["message"]["content"] == reference[0]
    assert answer["usage"]["completion_tokens"] == MAX_TOKENS and answer["choices"][0]["finish_reason"] == "length"
    text, finish, usage = server.stream(CHATS[1], MAX_TOKENS)
    assert text == reference[1]
    assert finish == "length" and usage["completion_tokens"] == MAX_TOKENS  # counted per token, as plain streams
    answers = {}
    threads = [threading.Thread(target=lambda i=i: answers.__setitem__(i, server.complete(CHATS[i], MAX_TOKENS)))
               for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [answers[i]["choices"][0]["message"]["content"] for i in range(4)] == reference
    # the server's model process decoded each request with the attached method (HF_SPECDEC_LOG_CALLS=1)
    calls = re.findall(r"hf_specdec assisted\S*: 1 row\(s\), \d+ tokens", server.log.read_text())
    assert len(calls) == 6, server.log_tail()
