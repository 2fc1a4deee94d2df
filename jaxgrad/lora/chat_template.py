r"""Chat templates rendered as transformers renders them, and Llama 3.1 Instruct's template.

Chat templates are rendered as ``transformers``' ``apply_chat_template(..., tokenize=False)``: a Jinja
``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with the ``loopcontrols`` extension, the
globals ``raise_exception`` (raises ``jinja2.TemplateError``) and ``strftime_now(format)``, a ``tojson`` filter that
is ``json.dumps`` (no HTML escaping; ``indent``, ``separators``, ``sort_keys``, ``ensure_ascii=False``), and the
variables ``messages``, ``tools`` (``None`` unless given), ``documents`` (likewise), ``add_generation_prompt``, the
special tokens (``bos_token``, ``eos_token``, ``unk_token``, ``sep_token``, ``pad_token``, ``cls_token``,
``mask_token`` as strings, where set) and any further keyword (``date_string=...``, ``enable_thinking=...``), a
keyword overriding a special token of the same name.

Tools must be JSON-schema dicts (transformers also turns Python functions into schemas; pass the schema instead).
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["LLAMA3_CHAT_TEMPLATE", "check_messages", "render_chat_template"]

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


@functools.lru_cache(maxsize=32)
def _compile_chat_template(template: str):
    """The template compiled in transformers' environment (cached: a conversation is rendered many times)."""
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


def check_messages(messages, name: str = "messages") -> list:
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise TypeError(f"{name}: expected a list of messages (dicts with 'role' and 'content'), got "
                        f"{type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message:
            raise TypeError(f"{name}[{i}]: expected a dict with a 'role' (and 'content'), got {message!r:.80}")
    return list(messages)


# transformers' marker for continue_final_message: appended to the final message, the rendering is cut where it lands.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool = False,
                         continue_final_message: bool | str = False, **variables: Any) -> str:
    """Render ``template`` over ``messages`` as transformers' ``apply_chat_template(tokenize=False)`` does.

    ``variables`` are the template's further variables (the special tokens, ``tools``, ``date_string``, ...);
    ``tools`` and ``documents`` are ``None`` unless given (a template sees them defined, as in transformers). Tools
    must be JSON-schema dicts. ``continue_final_message`` (True, or the name of the message field to continue) leaves
    the last message open so a model continues it: a marker is appended to that field, and the rendering is cut where
    the marker lands (and right-stripped if the template trimmed the marker's space), as transformers does. It excludes
    ``add_generation_prompt``.
    """
    import jinja2

    messages = check_messages(messages)
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
    if continue_final_message:
        messages, final = _tag_final_message(messages, continue_final_message, template)
    try:
        rendered = compiled.render(messages=messages, tools=tools, documents=documents,
                                   add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.TemplateError as err:
        raise ValueError(f"chat_template: rendering {len(messages)} message(s) failed: "
                         f"{type(err).__name__}: {err}") from err
    if continue_final_message:
        if final.strip() not in rendered or _CONTINUE_TAG.strip() not in rendered:
            raise ValueError("continue_final_message: the final message does not appear in the rendering (the "
                             "template alters or drops it)")
        at = rendered.rindex(_CONTINUE_TAG.strip())
        rendered = rendered[:at] if rendered[at: at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else rendered[:at].rstrip()
    return rendered


def _tag_final_message(messages: list, field: bool | str, template: str) -> tuple[list, str]:
    """A copy of ``messages`` whose last message's ``field`` (its last text block, for a list) ends with the tag."""
    import copy

    field = field if isinstance(field, str) else "content"
    if not messages or messages[-1].get(field) is None:
        raise ValueError(f"continue_final_message: the final message has no {field!r} to continue")
    if field not in template:
        raise ValueError(f"continue_final_message: {field!r} is not a field the chat template reads")
    messages = copy.deepcopy(messages)
    value = messages[-1][field]
    if isinstance(value, (list, tuple)):
        for block in reversed(value):
            if isinstance(block, dict) and "text" in block:
                final = block["text"]
                block["text"] = final + _CONTINUE_TAG
                return messages, final
        raise ValueError("continue_final_message: the final message has no text block to continue")
    messages[-1] = {**messages[-1], field: value + _CONTINUE_TAG}
    return messages, value
