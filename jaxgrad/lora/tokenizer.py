r"""Hugging Face tokenizers from a local directory, and chat templates rendered as transformers renders them.

A tokenizer directory holds ``tokenizer.json`` (the fast tokenizer: read with ``tokenizers.Tokenizer.from_file``)
and usually ``tokenizer_config.json``. Both are read as transformers 5 reads them:

* special tokens: ``bos_token``, ``eos_token``, ``pad_token``, ``unk_token``, ... as strings or AddedToken dicts
  ``{"content": ...}``; each must be in the vocabulary. ``special_tokens_map.json`` is read only when the config has
  no ``added_tokens_decoder`` (older saves), and then its tokens win;
* chat templates: ``chat_template.jinja`` (the default) and ``additional_chat_templates/<name>.jinja``, where
  present, replace the config's ``chat_template``, which is a string or a list of ``{"name", "template"}``. With
  several, "default" is used, "tool_use" when ``tools`` are given; without a "default", rendering without a named
  template is refused by name;
* ``encode`` adds what ``tokenizer.json``'s post-processor adds (Llama 3: the BOS): the config's ``add_bos_token`` /
  ``add_eos_token`` are not applied (transformers 5 drops them where a ``tokenizer.json`` exists); a flag that
  disagrees with the post-processor is warned about;
* ``clean_up_tokenization_spaces`` applies to non-BPE models only (for byte-level BPE, Llama 3's, transformers 5
  ignores it: it would strip real spaces before punctuation).

A slow, sentencepiece-only directory (``tokenizer.model`` without ``tokenizer.json``) is refused: convert it once
with transformers (``AutoTokenizer.from_pretrained(d).save_pretrained(d)`` writes ``tokenizer.json``).

Chat templates are rendered by :mod:`jaxgrad.lora.chat_template` as transformers renders them. Tokenizing a rendered
chat adds no special tokens (the template writes ``<|begin_of_text|>`` itself; adding the BOS again would double
it), as transformers does.

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
span ``[s, e)`` lies inside the union of the ``span_k``. A span is the message's content and what the template emits
after it (``<|eot_id|>``); a token crossing a span's boundary (text merged across it by the pre-tokenizer) belongs
to the prompt side. The Llama 3 pre-tokenizer splits at the special tokens and at the header's ``\n\n``, so no
token crosses.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
from collections.abc import Iterable, Mapping
from typing import Any

from jaxgrad.lora.chat_template import LLAMA3_CHAT_TEMPLATE, check_messages, render_chat_template

__all__ = [
    "LLAMA3_CHAT_TEMPLATE",
    "LLAMA3_SPECIAL_TOKENS",
    "TOKENIZER_FILE",
    "TOKENIZER_CONFIG_FILE",
    "CHAT_TEMPLATE_FILE",
    "CHAT_TEMPLATE_DIR",
    "SPECIAL_TOKENS_MAP_FILE",
    "Tokenizer",
    "load_tokenizer",
    "train_bpe_tokenizer",
    "render_chat_template",
]

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
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
    ``tokenizers.Tokenizer``; do not modify it. ``vocab_size`` counts the added tokens
    (``backend.get_vocab_size(with_added_tokens=True)``).
    """

    backend: Any = dataclasses.field(repr=False)
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    chat_template: str | None = dataclasses.field(default=None, repr=False)
    # named templates ((name, template), ...) where the directory has several: "default" is ``chat_template``,
    # "tool_use" is taken when tools are given, any other by ``apply_chat_template(..., chat_template=name)``
    chat_templates: tuple[tuple[str, str], ...] = dataclasses.field(default=(), repr=False)
    # the special tokens transformers passes to a chat template (SPECIAL_TOKEN_KEYS that are set)
    template_tokens: tuple[tuple[str, str], ...] = ()
    # decode() removes spaces before punctuation (transformers 5 does so only for non-BPE models)
    clean_up_tokenization_spaces: bool = False
    # tokenizer_config.json as read (a JSON string, so the object stays immutable); save() writes it back updated
    config_json: str = dataclasses.field(default="{}", repr=False)
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
        ``date_string``, ...), plus ``continue_final_message`` and ``chat_template`` (a template's name or text)."""
        messages = check_messages(messages)
        if not messages:
            raise ValueError("messages: the conversation is empty (at least one message is needed)")
        template = self._select_template(kwargs.pop("chat_template", None), kwargs.get("tools"))
        return self._render(template, messages, add_generation_prompt, **kwargs)

    def _render(self, template: str, messages: list, add_generation_prompt: bool = False, **kwargs) -> str:
        variables = dict(self.template_tokens)
        variables.update(kwargs)  # a keyword overrides a special token of the same name
        return render_chat_template(template, messages, add_generation_prompt=add_generation_prompt, **variables)

    def _select_template(self, chat_template: str | None, tools) -> str:
        """transformers' choice: a name among the named templates, else the text given; without one, "tool_use"
        when tools are given and the tokenizer has it, else the default."""
        named = dict(self.chat_templates)
        if chat_template is not None:
            return named.get(chat_template, chat_template)
        if tools is not None and "tool_use" in named:
            return named["tool_use"]
        if self.chat_template is not None:
            return self.chat_template
        if named:
            raise ValueError(f"chat_template: this tokenizer has the named templates {sorted(named)} and no "
                             "'default'; pass chat_template=<name>")
        raise ValueError("chat_template: this tokenizer has none (tokenizer_config.json has no 'chat_template' "
                         "and there is no chat_template.jinja); pass chat_template=... or use a chat model's "
                         "tokenizer")

    def _tokenize_rendering(self, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[bool]]:
        """Ids of ``text`` and a mask: True on tokens all of whose characters lie in ``spans``."""
        import bisect

        merged: list[list[int]] = []  # the union of the spans, as disjoint sorted intervals
        for a, b in sorted(spans):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            elif b > a:
                merged.append([a, b])
        starts = [a for a, _ in merged]
        ids, offsets = self.encode_with_offsets(text, add_special_tokens=False)
        mask = []
        for s, e in offsets:
            i = bisect.bisect_right(starts, s) - 1
            mask.append(e > s and i >= 0 and e <= merged[i][1])
        return ids, mask

    def tokenize_chat(self, messages: list[dict], **kwargs) -> tuple[list[int], list[bool]]:
        """Ids of the rendered conversation and its assistant mask (True on assistant tokens).

        The ids are transformers' ``apply_chat_template(messages, tokenize=True)`` (no special tokens added beyond
        what the template writes). The mask is True on the tokens of each assistant message's span: its content and
        what the template writes after it (Llama 3: ``<|eot_id|>``), found by prefix rendering (module docstring);
        a template whose renderings are not prefixes of each other is refused with a ``ValueError``. ``kwargs``
        reach the template.
        """
        full = self.apply_chat_template(messages, **kwargs)
        template = self._select_template(kwargs.pop("chat_template", None), kwargs.get("tools"))
        spans = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            try:
                prompt = self._render(template, messages[:k], add_generation_prompt=True, **kwargs)
                upto = self._render(template, messages[: k + 1], **kwargs)
            except ValueError as err:
                raise ValueError(f"chat_template: cannot render the conversation up to assistant message {k}, which "
                                 f"its assistant span needs ({err})") from err
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
        prompt = check_messages(prompt, "prompt")
        completion = check_messages(completion, "completion")
        head = self.apply_chat_template(prompt, add_generation_prompt=True)
        full = self.apply_chat_template(prompt + completion)
        if not full.startswith(head):
            raise ValueError("chat_template: the rendering of prompt + completion does not start with the rendering "
                             "of the prompt with add_generation_prompt=True, so the completion cannot be told apart")
        return self._tokenize_rendering(full, [(len(head), len(full))])

    # ---------------------------------------------------------------- files

    def save(self, directory) -> None:
        """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` into ``directory``
        (created if missing), readable by :func:`load_tokenizer` and by transformers' ``AutoTokenizer``.

        The config read at load time is kept, with this tokenizer's special tokens and templates (a string, or a
        list of ``{"name", "template"}`` when there are named templates). Template files already in ``directory``
        (``chat_template.jinja``, ``additional_chat_templates/*.jinja``), which would take precedence over the config,
        are rewritten with this tokenizer's templates (and removed where it has none).
        """
        directory = pathlib.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(directory / TOKENIZER_FILE))
        config = json.loads(self.config_json)
        config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        special = {}
        for key in SPECIAL_TOKEN_KEYS:
            value = dict(self.template_tokens).get(key)
            config[key] = value
            if value is not None:
                special[key] = value
        named = dict(self.chat_templates)
        if named:
            config["chat_template"] = [{"name": name, "template": text} for name, text in named.items()]
        elif self.chat_template is not None:
            config["chat_template"] = self.chat_template
        else:
            config.pop("chat_template", None)
        self._rewrite_template_files(directory, named)
        (directory / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                       encoding="utf-8")
        (directory / SPECIAL_TOKENS_MAP_FILE).write_text(json.dumps(special, indent=2, ensure_ascii=False) + "\n",
                                                         encoding="utf-8")

    def _rewrite_template_files(self, directory: pathlib.Path, named: dict) -> None:
        default_file, extra_dir = directory / CHAT_TEMPLATE_FILE, directory / CHAT_TEMPLATE_DIR
        if not default_file.exists() and not extra_dir.is_dir():
            return
        default_file.unlink(missing_ok=True)
        if self.chat_template is not None:
            default_file.write_text(self.chat_template, encoding="utf-8")
        if extra_dir.is_dir():
            for stale in extra_dir.glob("*.jinja"):
                stale.unlink()
        extras = {name: text for name, text in named.items() if name != "default"}
        if extras:
            extra_dir.mkdir(exist_ok=True)
            for name, text in extras.items():
                (extra_dir / f"{name}.jinja").write_text(text, encoding="utf-8")


def _named_templates(value, where: str) -> dict[str, str]:
    """A config's ``chat_template``: a string is the default; a list of ``{"name", "template"}`` names several."""
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        named = {}
        for entry in value:
            if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str) or \
                    not isinstance(entry.get("template"), str):
                raise ValueError(f"{where}: chat_template list entries must be {{'name': str, 'template': str}}, "
                                 f"got {entry!r:.80}")
            named[entry["name"]] = entry["template"]
        return named
    raise ValueError(f"{where}: chat_template must be a string or a list of {{'name', 'template'}}, "
                     f"got {type(value).__name__}")


def _read_templates(directory: pathlib.Path, config: Mapping) -> dict[str, str]:
    """The chat templates by name. ``chat_template.jinja`` ("default") and ``additional_chat_templates/<name>.jinja``,
    where present, replace the config's templates, as in transformers."""
    named = {}
    if (directory / CHAT_TEMPLATE_FILE).is_file():
        named["default"] = (directory / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    if (directory / CHAT_TEMPLATE_DIR).is_dir():
        for path in sorted((directory / CHAT_TEMPLATE_DIR).glob("*.jinja")):
            named[path.stem] = path.read_text(encoding="utf-8")
    return named or _named_templates(config.get("chat_template"), str(directory / TOKENIZER_CONFIG_FILE))


def _warn_on_ignored_bos_eos_flags(backend, config: Mapping, bos_id: int | None, eos_id: int | None) -> None:
    """``add_bos_token`` / ``add_eos_token`` are not applied: with a ``tokenizer.json``, its post-processor decides
    what ``encode`` adds (transformers 5 drops the two flags likewise). Where a flag disagrees with it, say so."""
    import warnings

    ids = backend.encode("", add_special_tokens=True).ids
    for flag, token_id, added in (("add_bos_token", bos_id, bool(ids) and ids[0] == bos_id),
                                  ("add_eos_token", eos_id, bool(ids) and ids[-1] == eos_id)):
        if flag in config and token_id is not None and bool(config[flag]) != added:
            warnings.warn(f"tokenizer_config.json sets {flag}={config[flag]!r} but tokenizer.json's post-processor "
                          f"{'adds' if added else 'does not add'} that token; encode() follows tokenizer.json, as "
                          "transformers 5 does", stacklevel=3)


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
    sentencepiece-only tokenizer), ``ValueError`` for a config that names tokens not in the vocabulary or
    malformed template entries.
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
    # special_tokens_map.json is read only beside a config without "added_tokens_decoder" (older saves), and then
    # its tokens win, as in transformers
    special_map_file = directory / SPECIAL_TOKENS_MAP_FILE
    special_map = {}
    if special_map_file.is_file() and "added_tokens_decoder" not in config:
        special_map = _read_json(special_map_file)

    tokens: dict[str, str] = {}
    for key in SPECIAL_TOKEN_KEYS:
        source, value = (special_map_file, special_map[key]) if special_map.get(key) is not None else \
            (config_file, config.get(key))
        value = _token_content(value, f"{source}: {key}")
        if value is not None:
            tokens[key] = value
    named = _read_templates(directory, config)
    bos, eos = tokens.get("bos_token"), tokens.get("eos_token")
    _warn_on_ignored_bos_eos_flags(backend, config, backend.token_to_id(bos) if bos else None,
                                   backend.token_to_id(eos) if eos else None)
    cleanup = bool(config.get("clean_up_tokenization_spaces", False)) and (
        type(backend.model).__name__ != "BPE"
        or bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)))
    return Tokenizer(
        backend=backend,
        bos_token=bos,
        eos_token=eos,
        pad_token=tokens.get("pad_token"),
        chat_template=named.get("default"),
        chat_templates=tuple(named.items()) if set(named) != {"default"} else (),
        template_tokens=tuple(tokens.items()),
        clean_up_tokenization_spaces=cleanup,
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
    def checked(texts):
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"texts[{i}]: expected a str, got {type(text).__name__}")
            yield text

    backend.train_from_iterator(checked(texts), trainer=trainer)
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
