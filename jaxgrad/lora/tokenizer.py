r"""Hugging Face tokenizers from a local directory, and chat templates rendered as transformers renders them.

A tokenizer directory holds ``tokenizer.json`` (the fast tokenizer: read with ``tokenizers.Tokenizer.from_file``)
and usually ``tokenizer_config.json``: the special tokens (``bos_token``, ``eos_token``, ``pad_token``, ... as strings
or AddedToken dicts ``{"content": ...}``), ``chat_template`` (a string, or a list of ``{"name", "template"}`` of which
``"default"`` is used), ``add_bos_token`` / ``add_eos_token`` and ``clean_up_tokenization_spaces``. A
``chat_template.jinja`` beside them (transformers >= 4.43 saves the template there) replaces the config's template,
as transformers does. ``special_tokens_map.json`` (older saves) fills only the special tokens the config leaves unset.
A slow, sentencepiece-only directory (``tokenizer.model`` without ``tokenizer.json``) is refused: convert it once
with transformers (``AutoTokenizer.from_pretrained(d).save_pretrained(d)`` writes ``tokenizer.json``).

Chat templates are rendered as ``transformers``' ``apply_chat_template(..., tokenize=False)``: a Jinja
``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with the ``loopcontrols`` extension, the
globals ``raise_exception`` (raises ``jinja2.TemplateError``) and ``strftime_now(format)``, a ``tojson`` filter that
is ``json.dumps`` (no HTML escaping; ``indent``, ``separators``, ``sort_keys``, ``ensure_ascii=False``), and the
variables ``messages``, ``tools`` (``None`` unless given), ``documents`` (likewise), ``add_generation_prompt``, the
special tokens (``bos_token``, ``eos_token``, ``pad_token``, ``unk_token``, ... as strings, where set) and any further
keyword (``date_string=...``, ``enable_thinking=...``), a keyword overriding a special token of the same name.
Tokenizing a rendered chat adds no special tokens (the template writes ``<|begin_of_text|>`` itself; adding the BOS
again would double it), as transformers does.

Assistant masks (:meth:`Tokenizer.tokenize_chat`): templates such as Llama 3's have no ``{% generation %}`` tags, so
the assistant spans are found by prefix rendering. For each assistant message ``k`` of ``messages``::

    P_k = render(messages[:k], add_generation_prompt=True)     # the conversation so far and the assistant header
    S_k = render(messages[:k + 1])                             # ... and assistant message k with its end-of-turn
    span_k = [len(P_k), len(S_k))                              # characters of the full rendering

The precondition (checked; a ``ValueError`` names the property that fails): ``S_k`` starts with ``P_k`` and the full
rendering starts with ``S_k`` -- the template renders a conversation's prefix as a prefix of the whole and writes the
generation prompt exactly as the header of the next assistant turn. Llama 3 / 3.1 and ChatML templates satisfy it;
a template that ends a rendering with something only the last message gets, or that changes earlier turns when later
ones arrive, does not. The full rendering is tokenized with offsets; a token is an assistant token iff its character
span ``[s, e)`` lies inside some ``span_k``. The span is the message's content and what the template emits after it
(``<|eot_id|>``); a token crossing a span's boundary (text merged across it by the pre-tokenizer) belongs to the
prompt side. The Llama 3 pre-tokenizer splits at the special tokens and at the header's ``\n\n``, so no token crosses.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "LLAMA3_CHAT_TEMPLATE",
    "LLAMA3_SPECIAL_TOKENS",
    "TOKENIZER_FILE",
    "TOKENIZER_CONFIG_FILE",
    "CHAT_TEMPLATE_FILE",
    "SPECIAL_TOKENS_MAP_FILE",
    "Tokenizer",
    "load_tokenizer",
    "train_bpe_tokenizer",
    "render_chat_template",
]

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
SLOW_TOKENIZER_FILES = ("tokenizer.model", "spiece.model", "sentencepiece.bpe.model")

# The special-token attributes transformers passes to a chat template (its ``special_tokens_map``), in its order.
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

# Llama 3 / 3.1: the first 8 of the 256 reserved special tokens (ids 128000-128255 in Meta's tokenizer), of which
# <|finetune_right_pad_id|> is the one meant for padding.
LLAMA3_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
    "<|finetune_right_pad_id|>",
)

# Llama 3's pre-tokenizer split (tokenizer.json of Meta-Llama-3 and 3.1): contractions, letters with one leading
# non-letter, 1-3 digits, punctuation runs, newlines, spaces.
LLAMA3_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# The chat template of Llama-3.1-8B-Instruct's tokenizer_config.json, as Meta ships it (two lines run past 120
# columns: the text is kept byte for byte).
LLAMA3_CHAT_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""


# ------------------------------------------------------------------------------------------------ templates


@functools.lru_cache(maxsize=32)
def _compile_chat_template(template: str):
    """The template compiled in transformers' environment (cached: a conversation is rendered many times)."""
    import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # json.dumps as is: Jinja's own tojson escapes <, >, & and ' for HTML, which a prompt must not get.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as err:
        raise ValueError(f"chat_template: not a valid Jinja template (line {err.lineno}: {err.message})") from err


def _check_messages(messages, name: str = "messages") -> list:
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise TypeError(f"{name}: expected a list of messages (dicts with 'role' and 'content'), got "
                        f"{type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message:
            raise TypeError(f"{name}[{i}]: expected a dict with a 'role' (and 'content'), got {message!r:.80}")
    return list(messages)


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool = False,
                         continue_final_message: bool = False, **variables: Any) -> str:
    """Render ``template`` over ``messages`` as transformers' ``apply_chat_template(tokenize=False)`` does.

    ``variables`` are the template's further variables (the special tokens, ``tools``, ``date_string``, ...);
    ``tools`` and ``documents`` are ``None`` unless given (a template sees them defined, as in transformers). Tools
    must be JSON-schema dicts. ``continue_final_message`` cuts the rendering after the last message's content (so a
    model continues it), as transformers does; it excludes ``add_generation_prompt``.
    """
    import jinja2

    messages = _check_messages(messages)
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt exclude each other: the first continues "
                         "the last message, the second opens a new assistant turn")
    tools = variables.pop("tools", None)
    if tools is not None:
        for i, tool in enumerate(tools):
            if not isinstance(tool, Mapping):
                raise TypeError(f"tools[{i}]: expected a JSON-schema dict, got {type(tool).__name__}")
    documents = variables.pop("documents", None)
    compiled = _compile_chat_template(template)
    try:
        rendered = compiled.render(messages=messages, tools=tools, documents=documents,
                                   add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.TemplateError as err:
        raise ValueError(f"chat_template: rendering {len(messages)} message(s) failed: "
                         f"{type(err).__name__}: {err}") from err
    if continue_final_message:
        rendered = _cut_after_final_message(rendered, messages)
    return rendered


def _cut_after_final_message(rendered: str, messages: list) -> str:
    if not messages:
        raise ValueError("continue_final_message: the conversation has no message to continue")
    final = messages[-1].get("content")
    if isinstance(final, (list, tuple)):
        texts = [block["text"] for block in final if isinstance(block, Mapping) and "text" in block]
        if not texts:
            raise ValueError("continue_final_message: the final message has no text block to continue")
        final = texts[-1]
    if not isinstance(final, str) or final.strip() not in rendered:
        raise ValueError("continue_final_message: the final message's content does not appear in the rendering "
                         "(the template alters it)")
    at = rendered.rindex(final.strip())
    if rendered[at: at + len(final.lstrip())] == final:
        return rendered[: at + len(final.lstrip())]
    return rendered[: at + len(final.strip())]  # the template trimmed trailing space off the message


def _token_content(value, where: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{where}: expected a string or an AddedToken dict {{'content': ...}}, got {value!r:.80}")


# ------------------------------------------------------------------------------------------------ tokenizer


@dataclasses.dataclass(frozen=True, eq=False)
class Tokenizer:
    """A fast (``tokenizers``) tokenizer with the special tokens and the chat template of its directory.

    Immutable after :func:`load_tokenizer` / :func:`train_bpe_tokenizer`: ``backend`` is this object's own
    ``tokenizers.Tokenizer`` (its post-processor set from ``add_bos_token`` / ``add_eos_token`` where the config gives
    them); do not modify it. ``vocab_size`` counts the added tokens
    (``backend.get_vocab_size(with_added_tokens=True)``).
    """

    backend: Any
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    chat_template: str | None = None
    # every special token transformers would pass to a chat template (SPECIAL_TOKEN_KEYS, additional_special_tokens)
    template_tokens: tuple[tuple[str, Any], ...] = ()
    clean_up_tokenization_spaces: bool = False
    # tokenizer_config.json as read (a JSON string, so the object stays immutable); save() writes it back updated
    config_json: str = "{}"
    vocab_size: int = dataclasses.field(init=False)
    bos_token_id: int | None = dataclasses.field(init=False)
    eos_token_id: int | None = dataclasses.field(init=False)
    pad_token_id: int | None = dataclasses.field(init=False)

    def __post_init__(self):
        set_ = functools.partial(object.__setattr__, self)
        set_("vocab_size", int(self.backend.get_vocab_size(with_added_tokens=True)))
        for name in ("bos", "eos", "pad"):
            token = getattr(self, f"{name}_token")
            token_id = None if token is None else self.backend.token_to_id(token)
            if token is not None and token_id is None:
                raise ValueError(f"{name}_token: {token!r} is not in the tokenizer's vocabulary "
                                 f"({self.vocab_size} tokens)")
            set_(f"{name}_token_id", token_id)

    # ---------------------------------------------------------------- text <-> ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies the post-processor (Llama 3: a leading BOS)."""
        if not isinstance(text, str):
            raise TypeError(f"text: expected a str, got {type(text).__name__}")
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_with_offsets(self, text: str, add_special_tokens: bool = False
                            ) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of ``text`` and each token's character span ``(start, end)`` in ``text``."""
        if not isinstance(text, str):
            raise TypeError(f"text: expected a str, got {type(text).__name__}")
        encoding = self.backend.encode(text, add_special_tokens=add_special_tokens)
        return list(encoding.ids), [tuple(o) for o in encoding.offsets]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """The text of ``ids`` (``clean_up_tokenization_spaces`` as the config says, as transformers does)."""
        text = self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces:
            for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                                  (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(before, after)
        return text

    # ---------------------------------------------------------------- chat

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False, **kwargs) -> str:
        """The conversation rendered by this tokenizer's chat template, as transformers'
        ``apply_chat_template(messages, tokenize=False, ...)`` renders it. ``kwargs`` reach the template (``tools``,
        ``date_string``, ...), plus ``continue_final_message`` and ``chat_template`` (another template string)."""
        template = kwargs.pop("chat_template", None) or self.chat_template
        if template is None:
            raise ValueError("chat_template: this tokenizer has none (tokenizer_config.json has no 'chat_template' "
                             "and there is no chat_template.jinja); pass chat_template=... or use a chat model's "
                             "tokenizer")
        variables = dict(self.template_tokens)
        variables.update(kwargs)
        return render_chat_template(template, messages, add_generation_prompt=add_generation_prompt, **variables)

    def _tokenize_rendering(self, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[bool]]:
        ids, offsets = self.encode_with_offsets(text, add_special_tokens=False)
        mask = [any(a <= s and e <= b for a, b in spans) and e > s for s, e in offsets]
        return ids, mask

    def tokenize_chat(self, messages: list[dict], **kwargs) -> tuple[list[int], list[bool]]:
        """Ids of the rendered conversation and its assistant mask (True on assistant tokens).

        The ids are transformers' ``apply_chat_template(messages, tokenize=True)`` (no special tokens added beyond
        what the template writes). The mask is True on the tokens of each assistant message's span: its content and
        what the template writes after it (Llama 3: ``<|eot_id|>``), found by prefix rendering (module docstring);
        a template whose renderings are not prefixes of each other is refused with a ``ValueError``. ``kwargs``
        reach the template.
        """
        messages = _check_messages(messages)
        full = self.apply_chat_template(messages, **kwargs)
        spans = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self.apply_chat_template(messages[:k], add_generation_prompt=True, **kwargs)
            upto = self.apply_chat_template(messages[: k + 1], **kwargs)
            if not upto.startswith(prompt):
                raise ValueError(
                    f"chat_template: the rendering of messages[:{k + 1}] does not start with the rendering of "
                    f"messages[:{k}] with add_generation_prompt=True (the generation prompt is not the header the "
                    "template writes before an assistant message), so the assistant span cannot be found: "
                    f"{prompt[-60:]!r} vs {upto[len(prompt) - 60: len(prompt)]!r}")
            if not full.startswith(upto):
                raise ValueError(
                    f"chat_template: the rendering of the whole conversation does not start with the rendering of "
                    f"messages[:{k + 1}] (the template renders a conversation's prefix differently from the start of "
                    "the whole, e.g. it marks the last message), so the assistant span cannot be found")
            spans.append((len(prompt), len(upto)))
        return self._tokenize_rendering(full, spans)

    def tokenize_prompt_completion(self, prompt: str | list[dict], completion: str | list[dict]
                                   ) -> tuple[list[int], list[bool]]:
        """Ids of a prompt-completion example and its completion mask (TRL's prompt-completion format).

        * Plain strings: ``encode(prompt)`` (with the special tokens the tokenizer adds, Llama 3: the BOS), then
          ``encode(completion, add_special_tokens=False)`` and the EOS (unless the completion's text already ends
          with the EOS token). The mask is True on the completion's tokens and the EOS. The two parts are tokenized
          apart, so the prompt's tokens are the ones the model sees at inference; TRL tokenizes ``prompt +
          completion`` as one text, which gives the same ids wherever no token spans the join.
        * Conversations (lists of messages): the chat template's rendering of ``prompt + completion``; the mask is
          True on the characters after ``render(prompt, add_generation_prompt=True)``, which must be a prefix of it
          (else a ``ValueError``), i.e. on the completion messages and what the template writes after them.
        """
        if isinstance(prompt, str) and isinstance(completion, str):
            if self.eos_token_id is None:
                raise ValueError("tokenize_prompt_completion: the tokenizer has no eos_token to end the completion")
            prompt_ids = self.encode(prompt)
            completion_ids = self.encode(completion, add_special_tokens=False)
            if not completion.endswith(self.eos_token):
                completion_ids.append(self.eos_token_id)
            return prompt_ids + completion_ids, [False] * len(prompt_ids) + [True] * len(completion_ids)
        if isinstance(prompt, str) or isinstance(completion, str):
            raise TypeError(f"prompt, completion: expected both strings or both lists of messages, got "
                            f"{type(prompt).__name__} and {type(completion).__name__}")
        prompt = _check_messages(prompt, "prompt")
        completion = _check_messages(completion, "completion")
        head = self.apply_chat_template(prompt, add_generation_prompt=True)
        full = self.apply_chat_template(prompt + completion)
        if not full.startswith(head):
            raise ValueError("chat_template: the rendering of prompt + completion does not start with the rendering "
                             "of the prompt with add_generation_prompt=True, so the completion cannot be told apart")
        return self._tokenize_rendering(full, [(len(head), len(full))])

    # ---------------------------------------------------------------- files

    def save(self, directory) -> None:
        """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` into ``directory``
        (created if missing), readable by :func:`load_tokenizer` and by transformers' ``AutoTokenizer``. The config
        read at load time is kept, its tokens and template set to this tokenizer's; a ``chat_template.jinja``
        already in ``directory`` is rewritten with the template (or removed when there is none), so it cannot
        override the saved config."""
        directory = pathlib.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(directory / TOKENIZER_FILE))
        config = json.loads(self.config_json)
        config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        config["clean_up_tokenization_spaces"] = self.clean_up_tokenization_spaces
        special = {}
        for key, value in self.template_tokens:
            config[key] = value
            special[key] = value
        for key in ("bos_token", "eos_token", "pad_token"):
            value = getattr(self, key)
            config[key] = value
            if value is not None:
                special[key] = value
        if self.chat_template is not None:
            if not _is_template_list(config.get("chat_template")) or \
                    _default_template(config["chat_template"], "config") != self.chat_template:
                config["chat_template"] = self.chat_template
        else:
            config.pop("chat_template", None)
        jinja_file = directory / CHAT_TEMPLATE_FILE
        if jinja_file.exists():
            if self.chat_template is None:
                jinja_file.unlink()
            else:
                jinja_file.write_text(self.chat_template, encoding="utf-8")
        (directory / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                       encoding="utf-8")
        (directory / SPECIAL_TOKENS_MAP_FILE).write_text(json.dumps(special, indent=2, ensure_ascii=False) + "\n",
                                                         encoding="utf-8")


def _is_template_list(value) -> bool:
    return isinstance(value, list)


def _default_template(value, where: str) -> str | None:
    """A config's ``chat_template``: a string, or the ``"default"`` entry of a list of ``{"name", "template"}``."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        names = []
        for entry in value:
            if not isinstance(entry, Mapping) or "name" not in entry or "template" not in entry:
                raise ValueError(f"{where}: chat_template list entries must be {{'name': ..., 'template': ...}}, "
                                 f"got {entry!r:.80}")
            names.append(entry["name"])
            if entry["name"] == "default":
                return entry["template"]
        raise ValueError(f"{where}: chat_template is a list of named templates {sorted(names)} without a 'default' "
                         "one; name one 'default' (or write it to chat_template.jinja)")
    raise ValueError(f"{where}: chat_template must be a string or a list of {{'name', 'template'}}, "
                     f"got {type(value).__name__}")


def _set_bos_eos_post_processor(backend, config: Mapping, bos: str | None, eos: str | None) -> None:
    """``add_bos_token`` / ``add_eos_token`` given in the config replace the post-processor by ``[bos] $A [eos]``
    (each flag missing counts as False), as transformers' fast tokenizer does."""
    from tokenizers import processors

    if "add_bos_token" not in config and "add_eos_token" not in config:
        return
    add_bos = bool(config.get("add_bos_token")) and bos is not None
    add_eos = bool(config.get("add_eos_token")) and eos is not None
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    special = ([(bos, backend.token_to_id(bos))] if add_bos else []) + \
              ([(eos, backend.token_to_id(eos))] if add_eos else [])
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _read_json(path: pathlib.Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def load_tokenizer(directory: str | os.PathLike) -> Tokenizer:
    """The tokenizer of a local Hugging Face directory (``tokenizer.json`` + ``tokenizer_config.json``).

    Raises ``FileNotFoundError`` naming ``tokenizer.json`` when it is missing (and saying how to convert a slow,
    sentencepiece-only tokenizer), ``ValueError`` for a config that names tokens not in the vocabulary or a list of
    chat templates without a ``"default"``.
    """
    from tokenizers import Tokenizer as Backend

    directory = pathlib.Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"tokenizer directory {directory}: no such directory")
    tokenizer_file = directory / TOKENIZER_FILE
    if not tokenizer_file.is_file():
        slow = [name for name in SLOW_TOKENIZER_FILES if (directory / name).is_file()]
        if slow:
            raise FileNotFoundError(
                f"{tokenizer_file}: missing; {directory} holds only the slow sentencepiece tokenizer {slow[0]}, "
                "which is not read. Convert it once with transformers: "
                f"AutoTokenizer.from_pretrained('{directory}').save_pretrained('{directory}') writes tokenizer.json")
        raise FileNotFoundError(f"{tokenizer_file}: missing (a fast Hugging Face tokenizer's tokenizer.json is "
                                "needed)")
    backend = Backend.from_file(str(tokenizer_file))
    config_file = directory / TOKENIZER_CONFIG_FILE
    config = _read_json(config_file) if config_file.is_file() else {}
    special_map_file = directory / SPECIAL_TOKENS_MAP_FILE
    special_map = _read_json(special_map_file) if special_map_file.is_file() else {}

    tokens: dict[str, Any] = {}
    for key in SPECIAL_TOKEN_KEYS:
        where = TOKENIZER_CONFIG_FILE if config.get(key) is not None else SPECIAL_TOKENS_MAP_FILE
        value = _token_content(config.get(key) if config.get(key) is not None else special_map.get(key),
                               f"{directory / where}: {key}")
        if value is not None:
            tokens[key] = value
    extra = config.get("additional_special_tokens") or special_map.get("additional_special_tokens")
    if extra:
        tokens["additional_special_tokens"] = [
            _token_content(t, f"{directory}: additional_special_tokens[{i}]") for i, t in enumerate(extra)]

    jinja_file = directory / CHAT_TEMPLATE_FILE
    if jinja_file.is_file():
        chat_template = jinja_file.read_text(encoding="utf-8")
    else:
        chat_template = _default_template(config.get("chat_template"), str(config_file))

    _set_bos_eos_post_processor(backend, config, tokens.get("bos_token"), tokens.get("eos_token"))
    return Tokenizer(
        backend=backend,
        bos_token=tokens.get("bos_token"),
        eos_token=tokens.get("eos_token"),
        pad_token=tokens.get("pad_token"),
        chat_template=chat_template,
        template_tokens=tuple((k, v) for k, v in tokens.items()),
        clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
        config_json=json.dumps(config),
    )


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, *, special_tokens=LLAMA3_SPECIAL_TOKENS,
                        chat_template: str | None = LLAMA3_CHAT_TEMPLATE, bos_token: str | None = "<|begin_of_text|>",
                        eos_token: str | None = "<|eot_id|>",
                        pad_token: str | None = "<|finetune_right_pad_id|>") -> Tokenizer:
    """A byte-level BPE trained on ``texts`` with the ``tokenizers`` library, built as Llama 3's tokenizer is.

    The pre-tokenizer is Llama 3's split pattern then byte-level; the 256 byte tokens come first, then the merges
    learnt from ``texts``, then ``special_tokens`` (as Llama 3 puts its special tokens after the BPE vocabulary).
    ``vocab_size`` counts all three: at least ``256 + len(special_tokens)``; texts too small to learn enough merges
    give a smaller vocabulary (``Tokenizer.vocab_size`` tells). ``encode`` adds ``bos_token`` at the start, as Llama
    3's post-processor does. The defaults (``eos_token="<|eot_id|>"``, ``pad_token="<|finetune_right_pad_id|>"``)
    are Llama 3.1 Instruct's; each token given must be one of ``special_tokens``.
    """
    from tokenizers import Regex, decoders, models, pre_tokenizers, processors, trainers
    from tokenizers import Tokenizer as Backend

    special_tokens = tuple(special_tokens)
    if len(set(special_tokens)) != len(special_tokens) or not all(isinstance(t, str) and t for t in special_tokens):
        raise ValueError(f"special_tokens: expected distinct non-empty strings, got {special_tokens!r}")
    for name, token in (("bos_token", bos_token), ("eos_token", eos_token), ("pad_token", pad_token)):
        if token is not None and token not in special_tokens:
            raise ValueError(f"{name}: {token!r} is not one of special_tokens {special_tokens!r}")
    if not isinstance(vocab_size, int) or vocab_size < 256 + len(special_tokens):
        raise ValueError(f"vocab_size: expected an int >= 256 byte tokens + {len(special_tokens)} special tokens = "
                         f"{256 + len(special_tokens)}, got {vocab_size!r}")
    if isinstance(texts, str):
        raise TypeError("texts: expected an iterable of strings, got one str")

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(special_tokens), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    backend.train_from_iterator((str(t) for t in texts), trainer=trainer)
    backend.add_special_tokens(list(special_tokens))
    byte_level = processors.ByteLevel(trim_offsets=False)
    if bos_token is not None:
        bos = processors.TemplateProcessing(single=f"{bos_token} $A", pair=f"{bos_token} $A {bos_token}:1 $B:1",
                                            special_tokens=[(bos_token, backend.token_to_id(bos_token))])
        backend.post_processor = processors.Sequence([byte_level, bos])
    else:
        backend.post_processor = byte_level
    template_tokens = tuple((k, v) for k, v in (("bos_token", bos_token), ("eos_token", eos_token),
                                                ("pad_token", pad_token)) if v is not None)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_input_names": ["input_ids", "attention_mask"],
              "clean_up_tokenization_spaces": False}
    return Tokenizer(backend=backend, bos_token=bos_token, eos_token=eos_token, pad_token=pad_token,
                     chat_template=chat_template, template_tokens=template_tokens,
                     config_json=json.dumps(config))
