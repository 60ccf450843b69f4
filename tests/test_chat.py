"""Chat templates: meshlm renders and tokenizes chats exactly as transformers' `apply_chat_template` does, and its
loss mask covers exactly the assistant turns."""

import json
from pathlib import Path

import pytest

from meshlm.chat import ChatTemplate, check_messages, load_chat_template
from meshlm.config import ConfigError, DataError
from meshlm.tokenizer import load_tokenizer
from tests.helpers.chat_templates import CHATML, CHATML_GENERATION, LLAMA2, ZEPHYR, tokenizer_folder

# What each template renders for one assistant message: content and end-of-turn, the tokens trained on
ASSISTANT_TURN = {
    "chatml": lambda content: content + "<|im_end|>\n",
    "llama2": lambda content: " " + content.strip() + " </s>",
    "zephyr": lambda content: content + "</s>\n",
}
TEMPLATES = {"chatml": CHATML, "llama2": LLAMA2, "zephyr": ZEPHYR, "generation": CHATML_GENERATION}

CHAT = [
    {"role": "system", "content": "You answer in one short sentence."},
    {"role": "user", "content": "What is a list in Python?"},
    {"role": "assistant", "content": "A mutable sequence of items."},
    {"role": "user", "content": "And a tuple?"},
    {"role": "assistant", "content": "🙂 An immutable sequence: naïve café."},
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    return {name: tokenizer_folder(tmp_path_factory.mktemp(name), t) for name, t in TEMPLATES.items()}


def reference(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def chats() -> list[list[dict]]:
    """Chats of several shapes: with and without a system prompt, one or two assistant turns, ending on the user."""
    return [CHAT, CHAT[1:], CHAT[:3], CHAT[1:4]]


@pytest.mark.parametrize("name", ["chatml", "llama2", "zephyr", "generation"])
def test_token_ids_equal_transformers_apply_chat_template(folders, name):
    folder = folders[name]
    hf, tok = reference(folder), load_tokenizer(folder)
    template = ChatTemplate.from_model_folder(folder)
    for chat in chats():
        for generation_prompt in (False, True):
            if generation_prompt and chat[-1]["role"] == "assistant":
                continue
            want = hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=generation_prompt)["input_ids"]
            assert template.encode(chat, tok, add_generation_prompt=generation_prompt) == want, (name, chat)
            assert template.render(chat, generation_prompt) == hf.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=generation_prompt
            )


def test_the_generation_prompt_is_rendered(folders):
    template = ChatTemplate.from_model_folder(folders["zephyr"])
    assert template.render(CHAT[:2], add_generation_prompt=True) == template.render(CHAT[:2]) + "<|assistant|>\n"


@pytest.mark.parametrize("name", ["chatml", "llama2", "zephyr"])
def test_the_mask_covers_exactly_each_assistant_turn(folders, name):
    """The masked tokens form one run per assistant message, decoding to its content and end-of-turn marker."""
    folder = folders[name]
    tok = load_tokenizer(folder)
    template = ChatTemplate.from_model_folder(folder)
    for chat in chats():
        ids, mask = template.encode_with_mask(chat, tok)
        assert ids == template.encode(chat, tok)
        runs, run = [], []
        for token, on in zip(ids, mask, strict=True):
            if on:
                run.append(token)
            elif run:
                runs.append(run)
                run = []
        runs += [run] if run else []
        expected = [ASSISTANT_TURN[name](m["content"]) for m in chat if m["role"] == "assistant"]
        assert [tok.decode(r) for r in runs] == expected, (name, chat)


def test_generation_blocks_give_transformers_assistant_mask(folders):
    """A template with {% generation %} blocks: the mask is transformers' `return_assistant_tokens_mask` (what trl's
    `assistant_only_loss=True` trains on), which here leaves out the newline after each `<|im_end|>`."""
    folder = folders["generation"]
    hf, tok = reference(folder), load_tokenizer(folder)
    template = ChatTemplate.from_model_folder(folder)
    for chat in chats():
        want = hf.apply_chat_template(chat, tokenize=True, return_assistant_tokens_mask=True)
        ids, mask = template.encode_with_mask(chat, tok)
        assert ids == want["input_ids"]
        assert [int(m) for m in mask] == want["assistant_masks"]
        assert any(mask)


def test_template_sources_follow_transformers(tmp_path):
    """chat_template.jinja wins over tokenizer_config.json; a list of named templates gives its "default"; a folder
    without one has none; --chat-template's file renders with the tokenizer's special tokens."""
    jinja = tokenizer_folder(tmp_path / "jinja", LLAMA2, jinja_file=True, chat_template=CHATML)
    assert (jinja / "chat_template.jinja").is_file()
    assert ChatTemplate.from_model_folder(jinja).source == reference(jinja).chat_template == LLAMA2
    named = tokenizer_folder(tmp_path / "named", chat_template=[{"name": "tool_use", "template": CHATML},
                                                                {"name": "default", "template": ZEPHYR}])  # fmt: skip
    assert ChatTemplate.from_model_folder(named).source == ZEPHYR
    assert reference(named).apply_chat_template(CHAT, tokenize=False) == ChatTemplate.from_model_folder(named).render(
        CHAT
    )
    plain = tokenizer_folder(tmp_path / "plain")
    assert load_chat_template(load_tokenizer(plain)) is None
    with pytest.raises(ConfigError, match="no chat template"):
        ChatTemplate.from_model_folder(plain)
    (tmp_path / "llama2.jinja").write_text(LLAMA2)
    given = load_chat_template(load_tokenizer(plain), tmp_path / "llama2.jinja")
    assert given.render(CHAT[1:3]) == "<s>[INST] What is a list in Python? [/INST] A mutable sequence of items. </s>"


def test_template_errors_are_one_line(folders, tmp_path):
    template = ChatTemplate.from_model_folder(folders["llama2"])
    with pytest.raises(DataError, match="refused this chat: Conversation roles must alternate"):
        template.render([CHAT[1], CHAT[1]])
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(ConfigError, match=r"bad.jinja: not a valid Jinja template \(line 1"):
        ChatTemplate.from_file(tmp_path / "bad.jinja")


def test_a_templates_runtime_error_is_one_line(folders):
    """A template's own code failing on the values it is given ({{ 1 // 0 }}, a `tools` of 5) is a DataError."""
    with pytest.raises(DataError, match="failed on this chat: ZeroDivisionError"):
        ChatTemplate("{{ 1 // 0 }}").render(CHAT)
    with pytest.raises(DataError, match="failed on this chat: TypeError"):
        ChatTemplate("{% for t in tools %}{{ t }}{% endfor %}").render(CHAT, tools=5)


TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}


def test_openais_tool_calling_turns_are_messages():
    """The assistant turn of a tool call (content null, as the openai SDK sends it back) and the tool's answer."""
    turns = [CHAT[1], {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
             {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}, {"role": "assistant", "tool_calls": [
             {"type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}]}]  # fmt: skip
    assert check_messages(turns) is turns
    bad = [
        ({"role": "user", "content": "x", "tool_calls": [TOOL_CALL]}, "only an assistant message makes tool calls"),
        ({"role": "assistant", "content": None, "tool_calls": {"a": 1}}, "tool_calls is dict, expected a list"),
        ({"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}, r"tool_calls\[0\] must be"),
        ({"role": "assistant", "content": None, "tool_calls": []}, "content is null, expected a string"),
        ({"role": "tool", "content": None}, r"messages\[1\].content is null"),
        ({"role": "tool", "tool_call_id": 3, "content": "x"}, "tool_call_id is int"),
    ]
    for message, words in bad:
        with pytest.raises(DataError, match=words):
            check_messages([CHAT[1], message])


def test_the_sandbox_holds(folders):
    """Templates are untrusted code: the sandbox refuses attribute access to Python internals, as transformers'."""
    template = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(Exception, match="unsafe|not safely|SecurityError|access"):
        template.render(CHAT)
    assert ChatTemplate("{{ messages | tojson }}").render(CHAT[:1]) == json.dumps(CHAT[:1], ensure_ascii=False)


def test_gpt2_bpe_through_tiktoken(gpt2_bpe_file, tmp_path):
    """GPT-J's own tokenizer (tiktoken; ChatML's tags are plain text to it): the ids of transformers' GPT-2 tokenizer
    built from the same BPE file, and the assistant turns masked through tiktoken's character offsets."""
    from meshlm.tokenizer import save_hf_tokenizer

    save_hf_tokenizer(tmp_path, gpt2_bpe_file)
    hf = reference(tmp_path)
    tok = load_tokenizer(gpt2_bpe_file)
    template = ChatTemplate(CHATML, tok.special_tokens)
    for chat in chats():
        want = hf.apply_chat_template(chat, chat_template=CHATML, tokenize=True)["input_ids"]
        ids, mask = template.encode_with_mask(chat, tok)
        assert ids == want
        trained = tok.decode_bytes([t for t, on in zip(ids, mask, strict=True) if on]).decode()
        assert trained == "".join(ASSISTANT_TURN["chatml"](m["content"]) for m in chat if m["role"] == "assistant")
    # a {% generation %} block that starts inside a token (':' + ':::' are one pre-token): that token is the
    # assistant's too, as transformers counts it
    straddle = "{% for m in messages %}{{ m.role + ':' }}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
    straddle += "{% endgeneration %}{% else %}{{ m.content }}{% endif %}{{ '\n' }}{% endfor %}"
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "::: it straddles"}]
    want = hf.apply_chat_template(chat, chat_template=straddle, tokenize=True, return_assistant_tokens_mask=True)
    ids, mask = ChatTemplate(straddle).encode_with_mask(chat, tok)
    assert ids == want["input_ids"] and [int(m) for m in mask] == want["assistant_masks"]
    assert tok.decode_bytes([t for t, on in zip(ids, mask, strict=True) if on]) == b":::: it straddles"
