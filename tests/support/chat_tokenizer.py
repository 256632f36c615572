"""A hand-made Hugging Face tokenizer directory with a chat template, for the tests of ``keys: vllm``.

A byte-level BPE with no merges (every byte one token: any text encodes, instantly), ChatML's
special tokens, a post-processor that puts ``<s>`` first (so ``add_special_tokens`` shows in the
ids) and ChatML's chat template in ``tokenizer_config.json``, as a served model's directory has it.
"""

from __future__ import annotations

import json
from pathlib import Path

#: ChatML's template (Qwen's and others'): each message between ``<|im_start|>ROLE\n`` and
#: ``<|im_end|>\n``, then the generation prompt.
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
BOS = "<s>"


def write_chat_tokenizer(directory: Path) -> Path:
    """Write the tokenizer (``tokenizer.json``, ``tokenizer_config.json``) to ``directory`` (created);
    returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    directory.mkdir(parents=True, exist_ok=True)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([BOS, "<|im_start|>", "<|im_end|>"])
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[
        (BOS, tokenizer.token_to_id(BOS))])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": "<|im_end|>",
        "model_max_length": 1_000_000, "clean_up_tokenization_spaces": False, "chat_template": CHATML}))
    return directory
