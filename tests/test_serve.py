"""``transformers serve`` (transformers' OpenAI-compatible server) on a model folder with a method attached
(``hf-specdec attach``), as a real server process (:class:`hf_specdec.bench.served.TransformersServer`): it loads the
folder with ``--trust-remote-code``, and every chat completion — plain, streamed, four at once — is decoded by the
attached method with plain greedy decoding's text; ``transformers chat``, its client, too.

Needs the serving extras (``pip install -e ".[serve]"``; ``.[test]`` includes them); skipped without them. One
server for the module: about 11 s to start on 2 cores, the requests under a second each.
"""

import os
import re
import subprocess
import sys
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


def _reference(folder, max_tokens: int = MAX_TOKENS) -> list[str]:
    """Plain greedy decoding of each chat: the folder loaded without trust_remote_code (transformers' generate)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    texts = []
    for chat in CHATS:
        inputs = tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=True, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, do_sample=False, max_new_tokens=max_tokens)
        texts.append(tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
    return texts


def _calls(server) -> int:
    """hf_specdec calls the server's log shows (HF_SPECDEC_LOG_CALLS=1): each was decoded by the attached method."""
    return len(re.findall(r"hf_specdec assisted\S*: 1 row\(s\), \d+ tokens", server.log.read_text()))


def test_chat_completions_plain_streamed_and_concurrent(server):
    reference = _reference(server.folder)
    before = _calls(server)
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
    assert _calls(server) == before + 6, server.log_tail()  # each decoded by the attached method


def test_transformers_chat_through_the_server(server):
    """`transformers chat` is a client of `transformers serve`: one greedy turn, then it exits."""
    reference = _reference(server.folder, max_tokens=8)[0]
    before = _calls(server)
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}  # its client refuses any URL offline
    chat = subprocess.run([sys.executable, "-m", "transformers.cli.transformers", "chat", server.folder, server.base,
                           "do_sample=False", "max_new_tokens=8"], input=f"{CHATS[0][0]['content']}\nn\n!exit\n",
                          capture_output=True, text=True, timeout=300,
                          env={**env, "HF_HUB_DISABLE_UPDATE_CHECK": "1"})
    assert chat.returncode == 0, chat.stderr[-3000:]
    assert "8 tokens in" in chat.stdout and reference in chat.stdout, chat.stdout[-2000:]
    assert _calls(server) == before + 1, server.log_tail()
