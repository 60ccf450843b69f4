"""Chat templates as published, and Hugging Face tokenizer folders that carry them."""

import functools
import json
from pathlib import Path

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>",
           "<|system|>"]  # fmt: skip

NAMED = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<|endoftext|>"}


CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' }}"
    "{{ '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# meta-llama/Llama-2-7b-chat-hf's template: the system prompt folded into the first user turn
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)

# HuggingFaceH4/zephyr-7b-beta's: newlines between its tags, which trim_blocks and lstrip_blocks remove
ZEPHYR = (
    "{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'] + "
    "eos_token }}\n{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n"
    "{% endif %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}"
)

# ChatML whose assistant turns are marked with {% generation %}, for transformers' own assistant mask
CHATML_GENERATION = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\n' }}{% else %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@functools.cache
def _bpe():
    """A byte-level BPE of 600 ids trained here (no hub) on Python's own help texts."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator([topics[k] for k in sorted(topics)[:60]], trainer)
    return tok.to_str()


def tokenizer_folder(
    folder: Path, template: str | None = None, jinja_file: bool = False, bos: bool = False, **config
) -> Path:
    """A Hugging Face tokenizer folder as `save_pretrained` writes it (bos <s>, eos </s>, pad <pad>), with `template`
    in tokenizer_config.json or, with `jinja_file`, in chat_template.jinja; `bos`: its post-processor puts <s> before
    every text, as Llama's does; `config` adds to tokenizer_config.json."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(_bpe())
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 3)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **NAMED)
    if template:
        fast.chat_template = template
    fast.save_pretrained(str(folder), save_jinja_files=jinja_file)
    if config:
        path = folder / "tokenizer_config.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | config))
    return folder
