"""jaxgrad.lora.tokenizer: local Hugging Face tokenizers, chat templates rendered as transformers renders them, and the
assistant / completion masks of conversations and prompt-completion examples.

Every test uses a byte-level BPE trained here on a few hundred generated lines (vocab 400): no network, no model files.
"""

from __future__ import annotations

import json
import warnings

import pytest

from jaxgrad.lora.tokenizer import (
    LLAMA3_CHAT_TEMPLATE,
    LLAMA3_SPECIAL_TOKENS,
    Tokenizer,
    load_tokenizer,
    render_chat_template,
    train_bpe_tokenizer,
)

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

SUBJECTS = ("the model", "a student", "my cat", "the weather", "our team", "this recipe", "the river", "a robot")
VERBS = ("likes", "needs", "writes about", "answers", "explains", "remembers", "counts", "follows")
OBJECTS = ("green apples", "long questions", "the small proof", "cold mornings", "three numbers", "every answer",
           "a quiet song", "the next step")


def corpus(lines: int = 400) -> list[str]:
    """Deterministic English-like lines with punctuation, digits and a little non-ASCII."""
    out = []
    for i in range(lines):
        s, v, o = SUBJECTS[i % 8], VERBS[(i // 8) % 8], OBJECTS[(i * 3) % 8]
        out.append(f"{s.capitalize()} {v} {o} ({i % 97} times)? Yes, it's true; café {i}!")
    return out


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return train_bpe_tokenizer(corpus(), 400)


CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What does the model like?"},
    {"role": "assistant", "content": "Green apples."},
    {"role": "user", "content": "  And the cat?  "},
    {"role": "assistant", "content": "The cat likes cold mornings, café au lait and 42 naps!"},
]

# Llama 3.1 Instruct's rendering of CONVERSATION, written out by hand: the system block carries the knowledge cutoff
# and the template's fixed date, every message is trimmed and ends with <|eot_id|>, the BOS comes from the template.
EXPECTED = (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
    "You are a terse assistant.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nWhat does the model like?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\nGreen apples.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nAnd the cat?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\nThe cat likes cold mornings, café au lait and 42 naps!<|eot_id|>"
)


def masked_runs(tok: Tokenizer, ids: list[int], mask: list[bool]) -> list[str]:
    """The decoded text of each maximal run of masked tokens."""
    runs, current = [], []
    for i, m in zip(ids, mask):
        if m:
            current.append(i)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tok.decode(run) for run in runs]


# ------------------------------------------------------------------------------------------- the trained tokenizer


def test_trained_tokenizer_has_the_llama3_special_tokens_after_the_bpe_vocabulary(tok):
    assert 256 + len(LLAMA3_SPECIAL_TOKENS) < tok.vocab_size <= 400
    assert tok.vocab_size == tok.backend.get_vocab_size(with_added_tokens=True)
    ids = [tok.backend.token_to_id(t) for t in LLAMA3_SPECIAL_TOKENS]
    assert ids == list(range(tok.vocab_size - len(LLAMA3_SPECIAL_TOKENS), tok.vocab_size))
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|begin_of_text|>", "<|eot_id|>",
                                                             "<|finetune_right_pad_id|>")
    assert tok.bos_token_id == ids[0] and tok.eos_token_id == ids[4] and tok.pad_token_id == ids[7]
    assert tok.chat_template == LLAMA3_CHAT_TEMPLATE


def test_encode_adds_one_bos_and_special_token_text_is_one_token(tok):
    text = "My cat likes green apples, 42 times!"
    plain = tok.encode(text, add_special_tokens=False)
    assert tok.encode(text) == [tok.bos_token_id] + plain
    assert tok.bos_token_id not in plain
    assert tok.decode(plain) == text
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == text
    assert tok.encode("hi<|eot_id|>", add_special_tokens=False)[-1] == tok.eos_token_id
    assert tok.encode("<|start_header_id|>", add_special_tokens=False) == [tok.backend.token_to_id(
        "<|start_header_id|>")]


def test_offsets_are_character_spans_of_the_text(tok):
    text = "café ☕ naps"
    ids, offsets = tok.encode_with_offsets(text)
    assert len(ids) == len(offsets) and tok.bos_token_id not in ids
    assert offsets[0][0] == 0 and offsets[-1][1] == len(text)
    assert all(0 <= s <= e <= len(text) for s, e in offsets)
    # a multi-byte character split into byte tokens: every piece reports the character's span
    cup = text.index("☕")
    assert (cup, cup + 1) in offsets


def test_train_bpe_tokenizer_refuses_bad_arguments():
    with pytest.raises(ValueError, match="vocab_size: expected an int >= 256 byte tokens"):
        train_bpe_tokenizer(corpus(10), 100)
    with pytest.raises(ValueError, match="eos_token: '<eos>' is not one of special_tokens"):
        train_bpe_tokenizer(corpus(10), 300, eos_token="<eos>")
    with pytest.raises(ValueError, match="special_tokens: expected distinct"):
        train_bpe_tokenizer(corpus(10), 300, special_tokens=("<a>", "<a>"), bos_token=None, eos_token=None,
                            pad_token=None)
    with pytest.raises(TypeError, match="texts: expected an iterable of strings"):
        train_bpe_tokenizer("one text", 300)
    with pytest.raises(TypeError, match=r"texts\[1\]: expected a str, got bytes"):
        train_bpe_tokenizer(["fine", b"bytes"], 300)


# ------------------------------------------------------------------------------------------- files


def test_save_and_load_give_the_same_tokenizer(tok, tmp_path):
    tok.save(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"tokenizer.json", "tokenizer_config.json",
                                                   "special_tokens_map.json"}
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["chat_template"] == LLAMA3_CHAT_TEMPLATE and config["eos_token"] == "<|eot_id|>"
    back = load_tokenizer(tmp_path)
    for text in corpus(20) + [EXPECTED, "<|eot_id|><|eot_id|>  spaces\n\nand lines"]:
        assert back.encode(text) == tok.encode(text)
        assert back.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
    for name in ("vocab_size", "bos_token", "eos_token", "pad_token", "bos_token_id", "eos_token_id",
                 "pad_token_id", "chat_template"):
        assert getattr(back, name) == getattr(tok, name), name
    assert back.tokenize_chat(CONVERSATION) == tok.tokenize_chat(CONVERSATION)


def test_tokenizer_is_immutable(tok):
    with pytest.raises(AttributeError):
        tok.eos_token = "<|end_of_text|>"


USER = [{"role": "user", "content": "x"}]


def write_dir(tmp, tok: Tokenizer, config: dict, **files: str):
    tok.backend.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps(config))
    for name, text in files.items():
        (tmp / name.replace("__", ".")).write_text(text)
    return tmp


def test_config_tokens_as_added_token_dicts_and_a_named_default_template(tok, tmp_path):
    config = {"bos_token": {"content": "<|begin_of_text|>", "lstrip": False},
              "eos_token": {"content": "<|end_of_text|>"}, "pad_token": None,
              "chat_template": [{"name": "tool_use", "template": "T"},
                                {"name": "default", "template": "D{{ eos_token }}"}]}
    t = load_tokenizer(write_dir(tmp_path, tok, config))
    assert (t.bos_token, t.eos_token, t.pad_token, t.pad_token_id) == ("<|begin_of_text|>", "<|end_of_text|>", None,
                                                                       None)
    assert t.eos_token_id == tok.backend.token_to_id("<|end_of_text|>")
    assert t.apply_chat_template(USER) == "D<|end_of_text|>"
    assert t.apply_chat_template(USER, chat_template="tool_use") == "T"
    assert t.apply_chat_template(USER, tools=[{"name": "f"}]) == "T"  # transformers takes "tool_use" with tools


def test_chat_template_jinja_file_takes_precedence_over_the_config(tok, tmp_path):
    config = {"bos_token": "<|begin_of_text|>", "chat_template": "from the config"}
    t = load_tokenizer(write_dir(tmp_path, tok, config, chat_template__jinja="from the file {{ bos_token }}"))
    assert t.apply_chat_template(USER) == "from the file <|begin_of_text|>"
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "rag.jinja").write_text("rag {{ messages | length }}")
    t = load_tokenizer(tmp_path)
    assert t.apply_chat_template(USER) == "from the file <|begin_of_text|>"
    assert t.apply_chat_template(USER, chat_template="rag") == "rag 1"
    # saving over the directory rewrites the template files, which would otherwise override the saved config
    tok.save(tmp_path)
    back = load_tokenizer(tmp_path)
    assert back.chat_template == LLAMA3_CHAT_TEMPLATE and back.chat_templates == ()
    assert not (tmp_path / "additional_chat_templates" / "rag.jinja").exists()


def test_special_tokens_map_is_read_beside_a_config_without_added_tokens_decoder(tok, tmp_path):
    special = json.dumps({"eos_token": "<|end_of_text|>", "pad_token": {"content": "<|finetune_right_pad_id|>"}})
    t = load_tokenizer(write_dir(tmp_path, tok, {"eos_token": "<|eot_id|>"}, special_tokens_map__json=special))
    assert t.eos_token == "<|end_of_text|>" and t.pad_token == "<|finetune_right_pad_id|>" and t.bos_token is None
    t = load_tokenizer(write_dir(tmp_path, tok, {"eos_token": "<|eot_id|>", "added_tokens_decoder": {}},
                                 special_tokens_map__json=special))
    assert t.eos_token == "<|eot_id|>" and t.pad_token is None


def test_encode_follows_tokenizer_json_and_warns_on_a_disagreeing_bos_eos_flag(tok, tmp_path):
    text = "green apples"
    expected = [tok.bos_token_id] + tok.encode(text, add_special_tokens=False)
    base = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        agreeing = load_tokenizer(write_dir(tmp_path, tok, {**base, "add_bos_token": True, "add_eos_token": False}))
    assert agreeing.encode(text) == expected
    with pytest.warns(UserWarning, match="add_bos_token=False but tokenizer.json's post-processor adds that token"):
        no_bos = load_tokenizer(write_dir(tmp_path, tok, {**base, "add_bos_token": False}))
    assert no_bos.encode(text) == expected
    with pytest.warns(UserWarning, match="add_eos_token=True but tokenizer.json's post-processor does not add"):
        eos = load_tokenizer(write_dir(tmp_path, tok, {**base, "add_eos_token": True}))
    assert eos.encode(text) == expected


def test_clean_up_tokenization_spaces_spares_byte_level_bpe(tok, tmp_path):
    ids = tok.encode("it 's true , yes .", add_special_tokens=False)
    t = load_tokenizer(write_dir(tmp_path, tok, {"clean_up_tokenization_spaces": True}))
    assert t.decode(ids) == "it 's true , yes ."  # Llama 3 sets the flag; transformers 5 ignores it for BPE
    forced = {"clean_up_tokenization_spaces": True,
              "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output": True}
    assert load_tokenizer(write_dir(tmp_path, tok, forced)).decode(ids) == "it's true, yes."


def test_missing_files_and_bad_configs_are_named(tok, tmp_path):
    with pytest.raises(FileNotFoundError, match="no such directory"):
        load_tokenizer(tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match="tokenizer.json: missing"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.model").write_bytes(b"\x00")
    with pytest.raises(FileNotFoundError, match=r"tokenizer.json: missing.*tokenizer.model.*save_pretrained"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.model").unlink()
    listed = {"chat_template": [{"name": "rag", "template": "R"}, {"name": "tool_use", "template": "T"}]}
    no_default = load_tokenizer(write_dir(tmp_path, tok, listed))
    assert no_default.encode("x") == tok.encode("x")  # the tokenizer itself is fine
    with pytest.raises(ValueError, match=r"named templates \['rag', 'tool_use'\] and no 'default'"):
        no_default.apply_chat_template(USER)
    assert no_default.apply_chat_template(USER, chat_template="rag") == "R"
    with pytest.raises(ValueError, match=r"chat_template list entries must be \{'name': str, 'template': str\}"):
        load_tokenizer(write_dir(tmp_path, tok, {"chat_template": [{"name": "default"}]}))
    with pytest.raises(ValueError, match="bos_token: '<s>' is not in the tokenizer's vocabulary"):
        load_tokenizer(write_dir(tmp_path, tok, {"bos_token": "<s>"}))
    with pytest.raises(ValueError, match="eos_token: expected a string or an AddedToken dict"):
        load_tokenizer(write_dir(tmp_path, tok, {"eos_token": 7}))
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json: not valid JSON"):
        load_tokenizer(tmp_path)


# ------------------------------------------------------------------------------------------- rendering


def test_llama3_rendering_of_a_multi_turn_conversation_with_a_system_message(tok):
    assert tok.apply_chat_template(CONVERSATION) == EXPECTED
    prompt = tok.apply_chat_template(CONVERSATION[:4], add_generation_prompt=True)
    assert prompt.endswith("And the cat?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


def test_llama3_rendering_without_a_system_message_and_with_a_date(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], date_string="1 Jan 2026")
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                    "Cutting Knowledge Date: December 2023\nToday Date: 1 Jan 2026\n\n<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>")


def test_tools_are_written_with_an_unescaped_indented_json(tok):
    tool = {"type": "function", "function": {"name": "add", "description": "a <b> & 'c'", "parameters": {}}}
    text = tok.apply_chat_template([{"role": "user", "content": "2+2?"}], tools=[tool])
    assert "Environment: ipython\n" in text
    assert json.dumps(tool, indent=4, ensure_ascii=False) + "\n\n2+2?<|eot_id|>" in text  # no \u003c, no &amp;
    with pytest.raises(TypeError, match=r"tools\[0\]: expected a JSON-schema dict"):
        tok.apply_chat_template([{"role": "user", "content": "x"}], tools=[len])


def test_the_environment_is_transformers_one():
    # trim_blocks / lstrip_blocks, loopcontrols, raise_exception, strftime_now, tojson without HTML escaping
    template = ("{% for m in messages %}\n  {% if loop.index > 2 %}{% break %}{% endif %}\n{{ m.content }};"
                "{% endfor %}{{ strftime_now('%Y') | length }}{{ {'a': '<&>'} | tojson }}")
    out = render_chat_template(template, [{"role": "user", "content": c} for c in "abc"])
    assert out == 'a;b;4{"a": "<&>"}'
    with pytest.raises(ValueError, match="rendering 1 message.*roles must alternate"):
        render_chat_template("{{ raise_exception('roles must alternate') }}", [{"role": "user", "content": ""}])
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        render_chat_template("{% if %}", [])


def test_keywords_override_special_tokens_and_continue_final_message(tok):
    assert tok.apply_chat_template(USER, chat_template="{{ bos_token }}|{{ eos_token }}", eos_token="E") == \
        "<|begin_of_text|>|E"
    partial = CONVERSATION[:2] + [{"role": "assistant", "content": "Green "}]
    text = tok.apply_chat_template(partial, continue_final_message=True)
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\nGreen")
    with pytest.raises(ValueError, match="exclude each other"):
        tok.apply_chat_template(partial, add_generation_prompt=True, continue_final_message=True)


def test_messages_must_be_a_list_of_role_dicts(tok):
    with pytest.raises(TypeError, match="messages: expected a list of messages"):
        tok.apply_chat_template("hello")
    with pytest.raises(ValueError, match="messages: the conversation is empty"):
        tok.apply_chat_template([])
    with pytest.raises(TypeError, match=r"messages\[1\]: expected a dict with a 'role'"):
        tok.tokenize_chat([{"role": "user", "content": "a"}, {"content": "b"}])


def test_a_tokenizer_without_a_template_says_so(tok, tmp_path):
    t = load_tokenizer(write_dir(tmp_path, tok, {}))
    assert t.chat_template is None
    with pytest.raises(ValueError, match="chat_template: this tokenizer has none"):
        t.apply_chat_template([{"role": "user", "content": "x"}])


# ------------------------------------------------------------------------------------------- masks


def test_tokenize_chat_masks_exactly_the_assistant_contents_and_their_eot(tok):
    ids, mask = tok.tokenize_chat(CONVERSATION)
    assert ids == tok.encode(EXPECTED, add_special_tokens=False)
    assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id  # the template's BOS, not a second one
    assert len(mask) == len(ids)
    assert masked_runs(tok, ids, mask) == ["Green apples.<|eot_id|>",
                                           "The cat likes cold mornings, café au lait and 42 naps!<|eot_id|>"]
    # everything else -- headers, system and user turns -- is unmasked
    unmasked = tok.decode([i for i, m in zip(ids, mask) if not m])
    assert "Green" not in unmasked and "naps" not in unmasked and "What does the model like?" in unmasked
    assert sum(mask) == sum(len(tok.encode(t, add_special_tokens=False)) for t in masked_runs(tok, ids, mask))


def test_tokenize_chat_without_assistant_turns_masks_nothing(tok):
    ids, mask = tok.tokenize_chat(CONVERSATION[:2])
    assert len(ids) == len(mask) and not any(mask)


def test_a_template_whose_generation_prompt_is_not_the_assistant_header_is_refused(tok):
    template = ("{% for m in messages %}{{ m.role + ': ' + m.content + '\n' }}{% endfor %}"
                "{% if add_generation_prompt %}ASSISTANT: {% endif %}")
    with pytest.raises(ValueError, match=r"messages\[:3\] does not start with the rendering of messages\[:2\] with "
                                         r"add_generation_prompt=True"):
        tok.tokenize_chat(CONVERSATION, chat_template=template)


def test_a_template_that_marks_the_last_message_is_refused(tok):
    template = ("{% for m in messages %}{{ m.role + ': ' + m.content }}"
                "{% if loop.last and not add_generation_prompt %} [end]{% endif %}{{ '\\n' }}"
                "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(ValueError, match=r"whole conversation does not start with the rendering of messages\[:3\]"):
        tok.tokenize_chat(CONVERSATION, chat_template=template)


def test_an_assistant_turn_whose_prefix_the_template_cannot_render_is_named(tok):
    # Llama 3's template reads messages[0]: the empty conversation before a leading assistant turn has no rendering
    with pytest.raises(ValueError, match="cannot render the conversation up to assistant message 0"):
        tok.tokenize_chat([{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Hi"}])


def test_the_repr_stays_short(tok):
    assert len(repr(tok)) < 600  # no vocabulary, no template text


def test_prompt_completion_strings_are_bos_prompt_then_completion_and_eos(tok):
    prompt, completion = "Our team counts three numbers:", " 1, 2, 3."
    ids, mask = tok.tokenize_prompt_completion(prompt, completion)
    prompt_ids = tok.encode(prompt)
    assert ids[: len(prompt_ids)] == prompt_ids and prompt_ids[0] == tok.bos_token_id
    assert ids[-1] == tok.eos_token_id
    assert mask == [False] * len(prompt_ids) + [True] * (len(ids) - len(prompt_ids))
    assert tok.decode(ids[len(prompt_ids):]) == completion + "<|eot_id|>"
    # a completion that already ends with the EOS text gets no second one
    ids2, mask2 = tok.tokenize_prompt_completion(prompt, completion + "<|eot_id|>")
    assert (ids2, mask2) == (ids, mask)


def test_prompt_completion_conversations_mask_the_completion_messages(tok):
    prompt, completion = CONVERSATION[:4], CONVERSATION[4:]
    ids, mask = tok.tokenize_prompt_completion(prompt, completion)
    full_ids, full_mask = tok.tokenize_chat(CONVERSATION)
    assert ids == full_ids
    # only the completion is masked: the earlier assistant turn of the prompt is context here
    assert masked_runs(tok, ids, mask) == ["The cat likes cold mornings, café au lait and 42 naps!<|eot_id|>"]
    assert sum(mask) < sum(full_mask)
    head = tok.encode(tok.apply_chat_template(prompt, add_generation_prompt=True), add_special_tokens=False)
    assert ids[: len(head)] == head and not any(mask[: len(head)]) and all(mask[len(head):])


def test_prompt_completion_refuses_mixed_kinds_and_a_missing_eos(tok, tmp_path):
    with pytest.raises(TypeError, match="prompt, completion: expected both strings or both lists"):
        tok.tokenize_prompt_completion("a", [{"role": "assistant", "content": "b"}])
    t = load_tokenizer(write_dir(tmp_path, tok, {"bos_token": "<|begin_of_text|>"}))
    with pytest.raises(ValueError, match="no eos_token"):
        t.tokenize_prompt_completion("a", "b")
