"""A checkpoint's tokenizer and chat template without transformers: the Rust `tokenizers` backend
read from the tokenizer.json that transformers writes, the template rendered by jinja2 the way
transformers' apply_chat_template renders it.

Why not transformers' own tokenizer: importing transformers and building its tokenizer was 1.6 of a
2.4 s load of a GGUF file (the 1.7B Q4_K_M one, 2026-11-26), where the Rust tokenizer reads back in
0.08 s. transformers still converts a GGUF file's vocabulary the first time (gguf.read_tokenizer) and
still reads a Hugging Face directory's tokenizer, whose classes may rewrite it on load.

Tokenizer answers the part of transformers' tokenizer API that Loom and its users lean on (calling it,
encode, decode, apply_chat_template, chat_template, the special tokens, backend_tokenizer), so that a
transformers tokenizer passed in its place (Engine.from_pretrained(tokenizer=...)) works the same.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer as Backend

if TYPE_CHECKING:
    import jinja2

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class Tokenizer:
    """A fast tokenizer: ``backend`` (tokenizers.Tokenizer), the special tokens by role
    ({"eos_token": "<|im_end|>", ...}) and the chat template (a str, a dict of named templates, or None)."""

    is_fast = True

    def __init__(self, backend: Backend, special_tokens: dict[str, str], chat_template: str | dict | None):
        self.backend_tokenizer = backend
        self.special_tokens_map = dict(special_tokens)
        self.chat_template = chat_template
        self._templates: dict[str, jinja2.Template] = {}

    @classmethod
    def from_directory(cls, directory: Path) -> Tokenizer:
        """From transformers' save_pretrained files: tokenizer.json, tokenizer_config.json and, where
        the template is not in the config, chat_template.jinja."""
        directory = Path(directory)
        config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates, saved as [{"name", "template"}]
            template = {entry["name"]: entry["template"] for entry in template}
        if (directory / "chat_template.jinja").is_file():  # the file first, as transformers reads them
            template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
        special = {role: _content(config[role]) for role in SPECIAL_TOKENS if config.get(role) is not None}
        return cls(Backend.from_file(str(directory / "tokenizer.json")), special, template)

    @classmethod
    def from_transformers(cls, tokenizer) -> Tokenizer:
        """The same tokenizer as a transformers fast tokenizer (its backend, tokens and template)."""
        special = {role: str(token) for role, token in tokenizer.special_tokens_map.items() if role in SPECIAL_TOKENS}
        return cls(tokenizer.backend_tokenizer, special, tokenizer.chat_template)

    def save_pretrained(self, directory) -> None:
        """Writes the files from_directory and transformers' AutoTokenizer read."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backend_tokenizer.save(str(directory / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **self.special_tokens_map}
        if isinstance(self.chat_template, dict):
            config["chat_template"] = [{"name": name, "template": text} for name, text in self.chat_template.items()]
        elif self.chat_template is not None:
            (directory / "chat_template.jinja").write_text(self.chat_template, encoding="utf-8")
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens=add_special_tokens)}

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """The text of ``ids`` (an int, ints, or a tensor or array of them)."""
        ids = [int(ids)] if isinstance(ids, int) or getattr(ids, "ndim", 1) == 0 else [int(i) for i in ids]
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self.backend_tokenizer.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None, documents: list[dict] | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = True, chat_template: str | None = None,
                            **variables):
        """The messages rendered by the chat template (``chat_template``: a named one, or a template
        of the caller's; with ``tools``, ``documents`` and any further template ``variables``), tokenized
        without adding special tokens unless ``tokenize`` is False. transformers' options past these
        (continue_final_message, return_dict, ...) are refused, not rendered as variables."""
        unsupported = sorted(UNSUPPORTED_OPTIONS & variables.keys())
        if unsupported:
            raise TypeError(f"apply_chat_template does not take {', '.join(unsupported)} here (Loom's tokenizer); "
                            "render with tokenize=False and tokenize the text instead")
        messages = [_as_transformers_renders(message) for message in messages]
        text = self._template(tools, chat_template).render(
            messages=messages, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens_map, **variables})
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _template(self, tools, chosen: str | None) -> jinja2.Template:
        template = self.chat_template
        if isinstance(template, dict) and chosen in template:
            template = template[chosen]
        elif chosen is not None:
            template = chosen
        elif template is None:
            raise ValueError("this tokenizer has no chat template")
        elif isinstance(template, dict):  # the tool-use template where tools are given, as transformers picks
            name = "tool_use" if tools is not None and "tool_use" in template else "default"
            if name not in template:
                raise ValueError(f"this tokenizer has several chat templates ({sorted(template)}) and no default")
            template = template[name]
        if template not in self._templates:
            from .chat_template import compiled  # (jinja2 is imported for chats alone)
            self._templates[template] = compiled(template)
        return self._templates[template]

    # The special tokens by role, and their ids, as transformers names them
    def __getattr__(self, name: str):
        role = name[:-3] if name.endswith("_id") else name
        if role in SPECIAL_TOKENS:
            token = self.special_tokens_map.get(role)
            return token if role == name or token is None else self.backend_tokenizer.token_to_id(token)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")


# apply_chat_template's options in transformers that Loom's tokenizer does not implement
UNSUPPORTED_OPTIONS = frozenset({"continue_final_message", "return_dict", "return_tensors", "return_assistant_tokens_mask",
                                 "padding", "truncation", "max_length", "tokenizer_kwargs", "sanitize_control_tokens"})
# A message's reasoning under the names templates read it by (the first the standard one)
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _as_transformers_renders(message: dict) -> dict:
    """A message as transformers hands it to a template: keys whose value is None dropped (OpenAI's
    content=None beside tool_calls), its reasoning under reasoning_content and thinking too."""
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[key] for key in REASONING_FIELDS if key in message), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _content(token) -> str:
    """A special token as tokenizer_config.json spells it: a str, or an AddedToken's {"content": ...}."""
    return token["content"] if isinstance(token, dict) else str(token)
