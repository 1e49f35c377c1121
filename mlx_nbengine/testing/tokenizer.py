"""The tiny models' tokenizer: a byte-level BPE trained offline on a few lines of text.

Vocabulary `VOCAB_SIZE` (512), with the special tokens `SPECIAL_TOKENS` first
(``<pad>``, ``<eos>``, ``<bos>``, ``<|im_start|>``, ``<|im_end|>``); encoding with special
tokens prepends ``<bos>``, and the chat template is ChatML-like. A family's own marks (the
vision families' image tokens) get the ids right after them, so no other id moves.
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<|im_start|>", "<|im_end|>"]

_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Enough varied English, digits and code-ish punctuation for 500 BPE merges.
_TRAINING_TEXT = """\
The Eiffel Tower is located in the city of Paris, the capital of France.
A block of two hundred and fifty six tokens is cached on disk and restored later.
Notebook users edit long prompts and run the cell again; the answer starts at once.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
def add(a, b):\n    return a + b\n\nprint(add(1, 2))  # 3
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 100 256 512 1024 2048 4096
Once upon a time there was a small model that learned to count and to speak.
The weather today is sunny with a light breeze from the west; tomorrow it may rain.
Machine learning models predict the next token from the tokens that came before.
Question: What is the capital of Italy? Answer: The capital of Italy is Rome.
Question: What is two plus two? Answer: Two plus two is four.
system user assistant hello world thank you please summarize explain translate
Jupyter kernels run code cells; magics start with a percent sign like %%llm.
"""


def special_ids(extra: tuple[str, ...] = ()) -> dict[str, int]:
    """The ids `make_tiny_tokenizer` gives `SPECIAL_TOKENS`, then `extra`, by name."""
    return {name: i for i, name in enumerate([*SPECIAL_TOKENS, *extra])}


def make_tiny_tokenizer(
    directory: str | Path,
    *,
    extra_special_tokens: tuple[str, ...] = (),
    chat_template: str = _CHAT_TEMPLATE,
    named_special_tokens: dict[str, str] | None = None,
) -> Path:
    """Train the tiny byte-level BPE and write tokenizer.json and tokenizer_config.json.

    `extra_special_tokens` get ids right after `SPECIAL_TOKENS` (the vision families'
    image tokens), so the other families' ids never move. `named_special_tokens` (for
    example ``{"image_token": "<|image|>"}``) go in tokenizer_config.json's
    ``extra_special_tokens``, which makes them tokenizer attributes (``tokenizer.image_token``,
    ``tokenizer.image_token_id``), where Gemma 4's processor looks for them.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[*SPECIAL_TOKENS, *extra_special_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeating the text changes counts, not the merges' order; 20 copies make ties rare.
    tok.train_from_iterator([_TRAINING_TEXT] * 20, trainer=trainer)
    bos_id = tok.token_to_id("<bos>")
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", bos_id)]
    )
    tok.save(str(directory / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": 131072,
        "chat_template": chat_template,
    }
    if named_special_tokens:
        tokenizer_config["extra_special_tokens"] = dict(named_special_tokens)
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    special_map = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
    (directory / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2))
    return directory
