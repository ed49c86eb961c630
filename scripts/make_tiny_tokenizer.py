#!/usr/bin/env python3
"""Generate the small byte-level BPE tokenizer shipped with prefixroute.

Writes ``src/prefixroute/data/tiny_tokenizer/tokenizer.json`` (the ``tokenizers``
library's format, as a Hugging Face model repository has it) and
``tokenizer_config.json`` (special tokens and the Jinja chat template, the two files a
vLLM server reads from a model directory). The emulated engine (``prefixroute emulate
--tokenizer tiny``) and the router's precise mode (``prefixroute serve --tokenizer
tiny``) load them through :mod:`prefixroute.core.model_tokenizer`.

The tokenizer is trained on a corpus built here, deterministically: the words of the
project's workloads, the words the emulated model generates, a few paragraphs of plain
English and the chat template's markers. It has a vocabulary of at most 1,024 tokens (810 from this corpus), a byte-level
alphabet (every UTF-8 text tokenizes, nothing is unknown) and adds
``<|begin_of_text|>`` in front of a completion prompt, as Llama 3's does.

Usage (needs the ``precise`` extra): ``python scripts/make_tiny_tokenizer.py [OUT_DIR]``.
The committed files were made with tokenizers 0.23; another release may merge ties in
another order, so re-running it can change token ids (the tests do not depend on
particular ids, only on the files being self-consistent).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 1024
BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
EOT = "<|eot_id|>"
SPECIAL_TOKENS = [BOS, EOS, "<|start_header_id|>", "<|end_header_id|>", EOT]

# The chat template, Llama 3 style: a BOS, then per message a header with the role and
# the trimmed content closed by <|eot_id|>; tool definitions, when given, go in a
# system block first as JSON. add_generation_prompt opens the assistant's header.
CHAT_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- if tools %}\n"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nTools available:\\n' }}\n"
    "{%- for tool in tools %}\n"
    "{{- tool | tojson }}\n"
    "{{- '\\n' }}\n"
    "{%- endfor %}\n"
    "{{- '<|eot_id|>' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}\n"
    "{%- if message['content'] is string %}\n"
    "{{- message['content'] | trim }}\n"
    "{%- endif %}\n"
    "{%- if message['tool_calls'] %}\n"
    "{{- message['tool_calls'] | tojson }}\n"
    "{%- endif %}\n"
    "{{- '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

_WORKLOAD_WORDS = (
    "cache prefix token router engine latency batch decode prefill block memory queue "
    "request instance model tensor kernel shard replica stream budget vector matrix "
    "policy affinity overflow tenant variant endpoint metric trace sample window layer "
    "attention context history document answer question system user assistant"
).split()
_OUTPUT_WORDS = ("the and for are but not you all any can had her was one our out day get has him his how "
                 "man new now old see two way who its say").split()
_PARAGRAPHS = (
    "Answer the user's question using only the document below. Summarise section two in one sentence.",
    "A request router sends prompts that begin the same way to the same instance, so that its "
    "prefix cache is warm and only the new part of the prompt is computed.",
    "The quick brown fox jumps over the lazy dog. She sells sea shells by the sea shore.",
    "What is the capital of France? Paris is the capital and the largest city of France.",
    "Please write a short poem about the ocean, the wind and the light of the morning.",
    "Here is the code: def main(): print('hello, world') # returns 0 when done",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 100 128 256 512 1000 1024 2048 4096 8192.",
    '{"name": "get_weather", "description": "Get the weather", "parameters": {"type": "object"}}',
    "Thank you! Could you explain it again, step by step, with an example?",
    "Time to first token, throughput, cache hit rate and latency are measured per run.",
)


def corpus(seed: int = 0) -> list[str]:
    """The training texts (deterministic for ``seed``)."""
    rng = random.Random(seed)
    lines = list(_PARAGRAPHS) * 20
    for _ in range(4000):
        words = [rng.choice(_WORKLOAD_WORDS) for _ in range(rng.randint(4, 24))]
        lines.append(" ".join(words))
    for _ in range(2000):
        lines.append(" ".join(rng.choice(_OUTPUT_WORDS) for _ in range(rng.randint(4, 16))))
    for role in ("system", "user", "assistant", "tool"):
        lines += [f"{role}\n\n{rng.choice(_PARAGRAPHS)}"] * 50
    return lines


def build() -> Tokenizer:
    """Train the tokenizer on :func:`corpus`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent / "src/prefixroute/data/tiny_tokenizer"
    out.mkdir(parents=True, exist_ok=True)
    tok = build()
    tok.save(str(out / "tokenizer.json"), pretty=False)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOT,
        "model_max_length": 131072,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"wrote {out}/tokenizer.json ({tok.get_vocab_size()} tokens) and tokenizer_config.json")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
