"""Chat templates rendered the way transformers' apply_chat_template renders them (tokenizer.py's
Tokenizer compiles its templates here, on first use: importing jinja2, 0.02-0.03 s, is then paid by
a process that renders a chat, not by every start-up)."""

from __future__ import annotations

import json
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.sandbox
import jinja2.utils


def compiled(template: str) -> jinja2.Template:
    """A chat template's text, compiled in transformers' environment (ENVIRONMENT)."""
    return ENVIRONMENT.from_string(template)


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``, which marks the assistant's text for training
    masks in some templates: rendered as its body."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """jinja2's namespace() refusing underscore names, as transformers' does: templates come from
    checkpoints, and the sandbox alone lets a namespace store them."""

    def __init__(*args, **kwargs):
        self, attributes = args[0], dict(*args[1:], **kwargs)
        for name in attributes:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not store {name!r} on a namespace")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja2's own tojson escapes HTML characters, which chat templates must not see
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


# The environment transformers renders chat templates in: sandboxed (templates are the checkpoint
# author's code), blocks trimmed, loop controls, and the globals templates are written against.
ENVIRONMENT = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=[_Generation, jinja2.ext.loopcontrols])
ENVIRONMENT.filters["tojson"] = _tojson
ENVIRONMENT.globals.update(raise_exception=_raise_exception, namespace=_Namespace,
                           strftime_now=lambda format: datetime.now().strftime(format))
