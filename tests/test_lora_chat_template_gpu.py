"""Our tokenizer files load in transformers, and our chat rendering and ids are transformers' own.

A byte-level BPE trained here (:func:`jaxgrad.lora.tokenizer.train_bpe_tokenizer`, Llama 3's pre-tokenizer, special
tokens and chat template) is saved with :meth:`Tokenizer.save` and loaded with ``transformers.AutoTokenizer``
(``PreTrainedTokenizerFast``; ``TokenizersBackend`` in transformers 5). For several conversations -- system / user /
assistant, multi-turn, with and without the generation prompt, with tools and a date --
``apply_chat_template(tokenize=False)`` must equal our rendering and ``apply_chat_template(tokenize=True)`` our
:meth:`Tokenizer.tokenize_chat` ids; ``encode`` and ``decode`` must agree; and a directory written by transformers'
``save_pretrained`` (``chat_template.jinja`` beside the config) must load back in :func:`load_tokenizer` unchanged.
Tokenizer work only: no torch tensors, no GPU memory. It is marked ``gpu`` because transformers lives only on the
GPU machine.
"""

from __future__ import annotations

import pytest

from jaxgrad.lora.tokenizer import load_tokenizer, train_bpe_tokenizer

pytestmark = pytest.mark.gpu

LINES = [f"Line {i}: the {w} model answers {i % 13} questions, café and naïve words; it's fine!"
         for i, w in enumerate(["small", "tiny", "quiet", "green", "useful", "plain"] * 60)]

SYSTEM = {"role": "system", "content": "You are a careful assistant.  "}
CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [SYSTEM, {"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."}],
    [SYSTEM, {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Green."},
     {"role": "user", "content": "  Another one, please.\n"}, {"role": "assistant", "content": "Blue, café-au-lait."}],
    [{"role": "user", "content": "One"}, {"role": "assistant", "content": "Two"}, {"role": "user", "content": "Three"}],
]
TOOL = {"type": "function", "function": {"name": "add", "description": "Add <a> & <b>.", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}


def _ids(out):
    """transformers 4 returns the ids, transformers 5 a BatchEncoding by default."""
    return list(out["input_ids"]) if hasattr(out, "keys") else list(out)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    ours = train_bpe_tokenizer(LINES, 420)
    directory = tmp_path_factory.mktemp("tokenizer")
    ours.save(directory)
    theirs = transformers.AutoTokenizer.from_pretrained(str(directory))
    return ours, theirs


def test_transformers_loads_our_files_with_the_same_special_tokens(pair):
    ours, theirs = pair
    assert theirs.is_fast  # PreTrainedTokenizerFast (transformers 4), TokenizersBackend (transformers 5)
    assert len(theirs) == ours.vocab_size
    assert (theirs.bos_token, theirs.eos_token, theirs.pad_token) == (ours.bos_token, ours.eos_token, ours.pad_token)
    assert (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id) == (
        ours.bos_token_id, ours.eos_token_id, ours.pad_token_id)
    assert theirs.chat_template == ours.chat_template


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_rendering_and_ids_equal_transformers(pair, index, add_generation_prompt):
    ours, theirs = pair
    messages = CONVERSATIONS[index]
    text = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == text
    ids = _ids(theirs.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt))
    assert ours.encode(text, add_special_tokens=False) == ids
    assert ids.count(ours.bos_token_id) == 1
    if not add_generation_prompt:
        chat_ids, mask = ours.tokenize_chat(messages)
        assert chat_ids == ids and len(mask) == len(ids)
        assert any(mask) == any(m["role"] == "assistant" for m in messages)


def test_tools_and_template_keywords_render_as_in_transformers(pair):
    ours, theirs = pair
    messages = CONVERSATIONS[1]
    for kwargs in ({"tools": [TOOL]}, {"date_string": "3 Mar 2026"}, {"tools": [TOOL], "tools_in_user_message": False}):
        text = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        assert ours.apply_chat_template(messages, add_generation_prompt=True, **kwargs) == text, kwargs


def test_prompt_completion_conversation_ids_are_transformers_rendering(pair):
    ours, theirs = pair
    prompt, completion = CONVERSATIONS[2][:4], CONVERSATIONS[2][4:]
    ids, mask = ours.tokenize_prompt_completion(prompt, completion)
    assert ids == _ids(theirs.apply_chat_template(prompt + completion, tokenize=True))
    head = _ids(theirs.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True))
    assert ids[: len(head)] == head and mask == [False] * len(head) + [True] * (len(ids) - len(head))


@pytest.mark.parametrize("text", ["", "Hello", LINES[3], "  spaces  and\n\nlines\t", "<|eot_id|>x<|begin_of_text|>",
                                  "naïve café ☕ 12345"])
def test_encode_and_decode_equal_transformers(pair, text):
    ours, theirs = pair
    assert ours.encode(text) == theirs.encode(text)
    assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
    ids = ours.encode(text)
    assert ours.decode(ids) == theirs.decode(ids)
    assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)


def test_a_directory_saved_by_transformers_loads_back_the_same(pair, tmp_path):
    transformers = pytest.importorskip("transformers")
    ours, theirs = pair
    theirs.save_pretrained(str(tmp_path))
    back = load_tokenizer(tmp_path)
    reloaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert back.chat_template == ours.chat_template  # from chat_template.jinja where transformers writes one
    assert (back.bos_token_id, back.eos_token_id, back.pad_token_id) == (
        ours.bos_token_id, ours.eos_token_id, ours.pad_token_id)
    for messages in CONVERSATIONS:
        assert back.tokenize_chat(messages) == ours.tokenize_chat(messages)
    for text in LINES[:5]:
        assert back.encode(text) == reloaded.encode(text) == ours.encode(text)
