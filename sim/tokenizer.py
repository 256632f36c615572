"""The simulator's tokenizer on disk: a Hugging Face tokenizer instead of the built-in one.

By default the simulator counts 4 bytes of rendered prompt as a token (:func:`sim.tokens.tokenize`),
so a client that counts with a real tokenizer disagrees with the server's ``usage`` (issue 38: a
benchmark client's 256 prompt tokens were 352-361 in the server's usage). ``inferlb sim-backend
--tokenizer DIR`` counts with the tokenizer in ``DIR`` (its ``tokenizer.json``, read by the
``tokenizers`` package: ``pip install 'inferlb[tokenizer]'``), the one the client loads from the same
directory (``transformers.AutoTokenizer.from_pretrained(DIR)``), so both count alike. When the
directory holds a chat template (``chat_template`` in its ``tokenizer_config.json``, or a
``chat_template.jinja``), chat prompts are rendered with it (:func:`load_chat_template`), as vLLM's
server renders them.

There is no model hub to download one from here, so :func:`write_small_tokenizer` (``inferlb
sim-tokenizer DIR``) writes a small one: a byte-level BPE (GPT-2's scheme: any text encodes, no
unknown token) trained on English-like text generated here from a fixed seed, with the
``tokenizer_config.json`` that makes ``AutoTokenizer`` load it as a ``PreTrainedTokenizerFast``.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["END_OF_TEXT", "load", "load_chat_template", "write_small_tokenizer"]

END_OF_TEXT = "<|endoftext|>"
_SURROGATE = re.compile("[\ud800-\udfff]")
_WORDS = (
    "the of and to in is it you that he was for on are with as his they be at one have this from or had by "
    "word but what some we can out other were all there when up use your how said an each she which do their "
    "time if will way about many then them write would like so these her long make thing see him two has look "
    "more day could go come did number sound no most people my over know water than call first who may down "
    "side been now find any new work part take get place made live where after back little only round man year "
    "came show every good me give our under name very through just form sentence great think say help low line "
    "differ turn cause much mean before move right boy old too same tell does set three want air well also play "
    "small end put home read hand port large spell add even land here must big high such follow act why ask men "
    "change went light kind off need house picture try us again animal point mother world near build self earth "
    "father head stand own page should country found answer school grow study still learn plant cover food sun "
    "four between state keep eye never last let thought city tree cross farm hard start might story saw far sea "
    "draw left late run while press close night real life few north open seem together next white children begin "
    "got walk example ease paper group always music those both mark often letter until mile river car feet care "
    "second book carry took science eat room friend began idea fish mountain stop once base hear horse cut sure "
    "watch color face wood main enough plain girl usual young ready above ever red list though feel talk bird soon "
    "body dog family direct pose leave song measure door product black short numeral class wind question happen "
    "complete ship area half rock order fire south problem piece told knew pass since top whole king space heard "
    "best hour better true during hundred five remember step early hold west ground interest reach fast verb sing "
    "listen six table travel less morning ten simple several vowel toward war lay against pattern slow center love "
    "person money serve appear road map rain rule govern pull cold notice voice unit power town fine certain fly "
    "fall lead cry dark machine note wait plan figure star box noun field rest correct able pound done beauty drive "
    "stood contain front teach week final gave green oh quick develop ocean warm free minute strong special mind "
    "behind clear tail produce fact street inch multiply nothing course stay wheel full force blue object decide "
    "surface deep moon island foot system busy test record boat common gold possible plane stead dry wonder laugh "
    "thousand ago ran check game shape equate hot miss brought heat snow tire bring yes distant fill east paint "
    "language among model server request token prompt answer cache memory batch queue latency gateway endpoint"
).split()


def _corpus(lines: int = 20000, seed: int = 38) -> Iterator[str]:
    """English-like lines from :data:`_WORDS` (capitals, numbers, punctuation, chat role markers),
    the same for the same arguments."""
    rng = random.Random(seed)
    marks = (".", ".", ".", ",", "?", "!", ":", ";")
    for i in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 24))]
        words[0] = words[0].capitalize()
        if rng.random() < 0.2:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 10_000)))
        line = " ".join(words) + rng.choice(marks)
        yield f"<|{('system', 'user', 'assistant')[i % 3]}|>\n{line}\n" if i % 7 == 0 else line


def write_small_tokenizer(directory: str | Path, vocab_size: int = 8192) -> Path:
    """Train the small byte-level BPE tokenizer (at most ``vocab_size`` tokens: its corpus gives about
    3 000) and write it to ``directory`` (created): its
    ``tokenizer.json`` (``tokenizers``), ``tokenizer_config.json`` and ``special_tokens_map.json``
    (for ``transformers.AutoTokenizer``). Deterministic: the same files for the same ``vocab_size``.
    Returns the directory.

    Raises:
        ModuleNotFoundError: the ``tokenizers`` package is not installed.
        OSError: the directory cannot be written.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[END_OF_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1_000_000, "bos_token": END_OF_TEXT,
        "eos_token": END_OF_TEXT, "unk_token": END_OF_TEXT, "pad_token": END_OF_TEXT,
        "clean_up_tokenization_spaces": False}, indent=1) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {name: END_OF_TEXT for name in ("bos_token", "eos_token", "unk_token", "pad_token")}, indent=1) + "\n")
    return out


def load(directory: str | Path) -> Callable[[str], list[int]]:
    """The ``encode`` of the tokenizer in ``directory`` (its ``tokenizer.json``): text -> token ids,
    no special tokens added (the prompt as the model server's tokenizer reads it); a lone surrogate
    in the text counts as U+FFFD, never an error.

    Raises:
        ModuleNotFoundError: the ``tokenizers`` package is not installed.
        OSError / ValueError: no readable ``tokenizer.json`` there (the message names the file).
    """
    from tokenizers import Tokenizer

    path = Path(directory) / "tokenizer.json"
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises its own Exception for a missing or bad file
        raise ValueError(f"{path}: not a Hugging Face tokenizer file ({err})") from None

    def encode(text: str) -> list[int]:
        try:
            return tokenizer.encode(text, add_special_tokens=False).ids
        except TypeError:  # a lone surrogate (JSON "\ud800"): not a str the tokenizer takes
            return tokenizer.encode(_SURROGATE.sub("\ufffd", text), add_special_tokens=False).ids

    return encode


def load_chat_template(directory: str | Path) -> Callable[[list[dict[str, Any]]], str] | None:
    """The chat template of the tokenizer in ``directory`` as vLLM's OpenAI server applies it by
    default (``transformers``' ``apply_chat_template``, not tokenized, the generation prompt added):
    messages -> prompt text; None when the directory has none (no ``chat_template`` in its
    ``tokenizer_config.json``, no ``chat_template.jinja``).

    Raises:
        ModuleNotFoundError: there is a template and the ``transformers`` package is not installed.
        ValueError: ``transformers`` cannot load the tokenizer there.
    """
    path = Path(directory)
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        config = {}
    if not (isinstance(config, dict) and config.get("chat_template")) and not (path / "chat_template.jinja").is_file():
        return None
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # no "None of PyTorch ..." line: not needed
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as err:  # transformers raises OSError, ValueError or its own for a bad directory
        raise ValueError(f"{path}: not a Hugging Face tokenizer directory ({err})") from None

    def render(messages: list[dict[str, Any]]) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    return render
