"""Chat templates: a model's Jinja template rendered as transformers' `apply_chat_template` renders it, so
the token ids are the ones `tokenizer.apply_chat_template(messages, tokenize=True)` gives.

The same sandboxed Jinja environment (trim_blocks, lstrip_blocks, loop controls, `raise_exception`,
`strftime_now`, transformers' `tojson`, `dict` and `namespace`, the `{% generation %}` tag), the same
variables (`messages`, `tools`, `documents`, `add_generation_prompt` and the tokenizer's named special
tokens: `bos_token`, `eos_token`, ...), and the rendered text tokenized without adding special tokens (a
template writes its own BOS). `meshlm prepare` and the server's chat endpoint both render through here.

Which tokens carry the loss of a chat (`encode_with_mask`): a template with `{% generation %}` blocks
marks them itself, and every token overlapping a block counts, exactly transformers'
`return_assistant_tokens_mask` (what trl's `assistant_only_loss=True` trains on). Most templates have no
such block, and trl then refuses `assistant_only_loss`; here each assistant turn counts from the end of
the chat rendered up to it with the generation prompt, to the end of the chat rendered through it: the
message's content and its end-of-turn marker, what the model must learn to produce after the prompt.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

from meshlm.config import ConfigError, DataError
from meshlm.paths import as_path
from meshlm.tokenizer import HFTokenizer, Tokenizer, named_special_tokens, tokenizer_config

TEMPLATE_FILE = "chat_template.jinja"
ROLES = ("system", "developer", "user", "assistant", "tool")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' aliases of one field
_GENERATION_TAG = re.compile(r"\{\%-?\s*generation\s*-?\%\}")
_SPANS: ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = ContextVar("generation_spans", default=None)

Message = Mapping[str, Any]


class ChatTemplate:
    """One chat template with the special tokens it renders with. `render` gives the text; `encode` its ids;
    `encode_with_mask` the ids of a whole chat and which of them are the assistant's (module docstring)."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None, name: str = "chat template"):
        import jinja2

        self.source, self.name = source, name
        self.special_tokens = dict(special_tokens or {})
        self.has_generation_blocks = bool(_GENERATION_TAG.search(source))
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ConfigError(f"{name}: not a valid Jinja template (line {e.lineno}: {e.message})") from None

    @classmethod
    def from_model_folder(cls, folder: str | Path, special_tokens: Mapping[str, str] | None = None) -> ChatTemplate:
        """The template of a Hugging Face model folder: `chat_template.jinja`, else `chat_template` in its
        `tokenizer_config.json` (a string, or a list of named templates, of which "default" is taken), as
        transformers loads it; the special tokens are the config's unless given."""
        found = find_template(folder)
        if found is None:
            raise ConfigError(
                f"{folder}: no chat template ({TEMPLATE_FILE}, or chat_template in tokenizer_config.json)"
            )
        if special_tokens is None:
            special_tokens = named_special_tokens(tokenizer_config(folder))
        return cls(found[0], special_tokens, found[1])

    @classmethod
    def from_file(cls, path: str | Path, special_tokens: Mapping[str, str] | None = None) -> ChatTemplate:
        try:
            source = as_path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: cannot read the chat template ({e.__class__.__name__})") from None
        return cls(source, special_tokens, str(path))

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = False, **kwargs: Any) -> str:
        """The chat as text; `kwargs` (`tools`, `documents`, a template's own switches) reach the template as
        variables. A template's `raise_exception` (a role it does not know, turns out of order) raises
        DataError with its message."""
        return self._render(messages, add_generation_prompt, kwargs, None)

    def encode(
        self, messages: Sequence[Message], tokenizer: Tokenizer, add_generation_prompt: bool = False, **kwargs: Any
    ) -> list[int]:
        return tokenizer.encode(self.render(messages, add_generation_prompt, **kwargs))

    def encode_with_mask(
        self, messages: Sequence[Message], tokenizer: Tokenizer, **kwargs: Any
    ) -> tuple[list[int], list[bool]]:
        """The chat's ids, and for each id whether it is an assistant token (module docstring)."""
        spans: list[tuple[int, int]] = []
        if self.has_generation_blocks:
            text = self._render(messages, False, kwargs, spans)
        else:
            text = self.render(messages, **kwargs)
            for i, message in enumerate(messages):
                if message.get("role") == "assistant":
                    start = common_prefix(self.render(messages[:i], True, **kwargs), text)
                    end = common_prefix(self.render(messages[: i + 1], **kwargs), text)
                    spans.append((start, end))
        ids, offsets = tokenizer.encode_offsets(text)
        return ids, _overlapping(offsets, spans)

    def _render(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool,
        kwargs: Mapping[str, Any],
        spans: list[tuple[int, int]] | None,
    ) -> str:
        """Render, appending the span of each {% generation %} block to `spans` if given. Messages lose their
        None values, as transformers drops them (templates test for a key, not for None)."""
        import jinja2

        chat = _alias_reasoning([{k: v for k, v in dict(m).items() if v is not None} for m in messages])
        variables = {**self.special_tokens, "tools": None, "documents": None, **kwargs}
        blocks: list[str] = []
        token = _SPANS.set((blocks, spans) if spans is not None else None)
        try:
            for block in self._template.generate(
                messages=chat, add_generation_prompt=add_generation_prompt, **variables
            ):
                blocks.append(block)
        except jinja2.TemplateError as e:
            raise DataError(f"the chat template refused this chat: {e.message or e}") from None
        except (ArithmeticError, LookupError, TypeError, ValueError, AttributeError, RecursionError) as e:
            # the template's own code failed on these values ({{ 1 // 0 }}, a `tools` it cannot iterate)
            raise DataError(f"the chat template failed on this chat: {type(e).__name__}: {e}") from None
        finally:
            _SPANS.reset(token)
        return "".join(blocks)


def find_template(folder: str | Path) -> tuple[str, str] | None:
    """(source, where it came from) of a model folder's chat template, None when it has none."""
    folder = as_path(folder)
    if (folder / TEMPLATE_FILE).is_file():
        return (folder / TEMPLATE_FILE).read_text(encoding="utf-8"), str(folder / TEMPLATE_FILE)
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    template = config.get("chat_template") if isinstance(config, dict) else None
    where = str(folder / "tokenizer_config.json")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise ConfigError(f"{where}: several chat templates ({sorted(map(str, named))}) and none named 'default'")
        return named["default"], f"{where} (template 'default')"
    return (template, where) if isinstance(template, str) else None


def load_chat_template(tokenizer: Tokenizer, template_file: str | Path | None = None) -> ChatTemplate | None:
    """`template_file` if given, else the template beside the tokenizer's tokenizer.json (its model folder);
    None when there is none. Either renders with the tokenizer's special tokens."""
    if template_file is not None:
        return ChatTemplate.from_file(template_file, tokenizer.special_tokens)
    folder = tokenizer.path.parent if isinstance(tokenizer, HFTokenizer) else None
    if folder is None or find_template(folder) is None:
        return None
    return ChatTemplate.from_model_folder(folder, tokenizer.special_tokens)


def check_messages(messages: Any, field: str = "messages") -> list[dict[str, Any]]:
    """A list of {"role", "content"} messages with known roles and string contents, in OpenAI's shapes: an
    assistant message that makes `tool_calls` may have no content (null, as the openai SDK sends it back), and
    a `tool` message answers one (`tool_call_id`). DataError says what is not."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{field!r} must be a non-empty list of messages, got {_describe(messages)}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise DataError(f"{field}[{i}] must be an object with 'role' and 'content', got {_describe(message)}")
        if message["role"] not in ROLES:
            raise DataError(f"{field}[{i}] has unknown role {message['role']!r}; roles are {', '.join(ROLES)}")
        calls = message.get("tool_calls")
        if calls is not None:
            _check_tool_calls(calls, f"{field}[{i}]", message["role"])
        if message.get("content") is None and calls:
            continue  # an assistant's tool calls stand for its content
        if "content" not in message:
            raise DataError(f"{field}[{i}] must be an object with 'role' and 'content', got {_describe(message)}")
        if not isinstance(message["content"], str):
            raise DataError(f"{field}[{i}].content is {_describe(message['content'])}, expected a string")
        if message["role"] == "tool" and not isinstance(message.get("tool_call_id", ""), str):
            raise DataError(f"{field}[{i}].tool_call_id is {_describe(message['tool_call_id'])}, expected a string")
    return messages


def _check_tool_calls(calls: Any, where: str, role: str) -> None:
    """OpenAI's `tool_calls`: on an assistant message, a list of {"type": "function", "function": {"name",
    "arguments"}} (arguments as JSON text, or already an object)."""
    if role != "assistant":
        raise DataError(f"{where}.tool_calls: only an assistant message makes tool calls, not a {role!r} one")
    if not isinstance(calls, list):
        raise DataError(f"{where}.tool_calls is {_describe(calls)}, expected a list")
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise DataError(f"{where}.tool_calls[{j}] must be {{type: function, function: {{name, arguments}}}}")
        if not isinstance(function.get("arguments", {}), str | dict):
            raise DataError(f"{where}.tool_calls[{j}].function.arguments must be JSON text or an object")


def _describe(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def common_prefix(a: Sequence, b: Sequence) -> int:
    """How many leading items (characters, token ids) `a` and `b` share: trl's `common_prefix_length`."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _overlapping(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[bool]:
    """For each token's character span, whether it overlaps one of `spans` (ordered, disjoint): transformers'
    rule, so a token straddling a boundary belongs to the assistant."""
    mask, k = [], 0
    for start, end in offsets:
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        mask.append(k < len(spans) and end > spans[k][0])
    return mask


def _alias_reasoning(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """transformers fills `reasoning_content` (and `thinking`) from whichever of its names a message uses."""
    out = []
    for message in chat:
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        out.append(message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning})
    return out


@cache
def _environment() -> Any:
    """transformers' chat-template environment (`_cached_compile_jinja_template`), built once."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: records the block's span in the text rendered so far."""

        tags = {"generation"}  # noqa: RUF012 - jinja2's own class attribute

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_block"), [], [], body).set_lineno(lineno)

        def _block(self, caller: Any) -> str:
            text = caller()
            if (tracking := _SPANS.get()) is not None:
                blocks, spans = tracking
                start = len("".join(blocks))
                spans.append((start, start + len(text)))
            return text

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class TemplateDict:
        """`dict(...)` without the attribute access a sandbox escape would use."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """`namespace(...)` refusing underscore names, which reach CPython internals."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception,
        strftime_now=lambda fmt: datetime.now().strftime(fmt),
        dict=TemplateDict(),
        namespace=TemplateNamespace,
    )
    return env
