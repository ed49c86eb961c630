"""Write a tiny random-weight Llama-architecture GGUF model that llama.cpp can serve.

No model weights can be downloaded where prefixroute is tested, so the real-engine
benchmark (:mod:`prefixroute.engines.llama_cpp`) serves a model made here, in about a
second, from a seed. Its outputs are gibberish; what matters is that llama.cpp runs the
real prefill (every layer's attention over the whole prompt, so the cost grows with the
number of prompt tokens, faster than linearly) and really reuses the KV cache of a
prompt prefix it has already seen.

The model:

* architecture ``llama`` (RMSNorm, RoPE, multi-head attention, SwiGLU feed-forward),
  ``layers`` blocks of width ``width`` with ``heads`` heads, all weights float32;
* a byte-level vocabulary of 260 tokens for llama.cpp's SentencePiece ("llama")
  tokenizer: ``<unk>`` (0), ``<s>`` (1, BOS), ``</s>`` (2, EOS), the 256 byte tokens
  ``<0x00>``..``<0xFF>`` (3..258, type BYTE) and ``▁`` (259, U+2581, the tokenizer's
  escaped space). No other pieces exist, so the tokenizer falls back to byte tokens for
  every character: **any UTF-8 text tokenizes, one token per byte (a space is one
  token)**, plus one BOS token. A 6,000-character ASCII prompt is 6,001 tokens.
* a context length of ``context`` tokens (default 16,384);
* an output layer that only ever favours printable ASCII (0x20-0x7E): the rows of every
  other token are zero and the printable rows large, so sampling at any usual
  temperature never picks EOS, a control byte or half a UTF-8 sequence. Every request
  therefore generates exactly ``max_tokens`` visible characters.
* a chat template with the router's chat rendering (``<|role|>\\n`` + content +
  ``\\n`` per message, then ``<|assistant|>\\n``;
  :func:`prefixroute.core.routing_text.render_chat_text`),
  so ``/v1/chat/completions`` works too.

This file imports only the standard library, ``numpy`` and ``gguf`` (the GGUF writer of
the llama.cpp project, on PyPI), so it runs under any Python that has those two, without
prefixroute installed::

    python src/prefixroute/engines/tiny_gguf.py /tmp/tiny.gguf
    python -m prefixroute.engines.tiny_gguf /tmp/tiny.gguf --layers 2 --width 128

Measured on a 2-core x86 machine with llama.cpp (llama-cpp-python 0.3.36), one thread,
the defaults: see docs/LLAMA_CPP.md.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TinyModelSpec", "write_tiny_gguf", "VOCAB_SIZE", "BYTE_TOKEN_OFFSET", "SPACE_TOKEN", "main"]

#: Token ids of the vocabulary (see the module docstring).
UNK_TOKEN, BOS_TOKEN, EOS_TOKEN = 0, 1, 2
BYTE_TOKEN_OFFSET = 3  # byte b is token 3 + b
SPACE_TOKEN = BYTE_TOKEN_OFFSET + 256  # "▁", SentencePiece's escaped space
VOCAB_SIZE = SPACE_TOKEN + 1

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True, slots=True)
class TinyModelSpec:
    """The shape of the generated model.

    Attributes:
        layers: transformer blocks (>= 1).
        width: embedding width (``n_embd``), a multiple of ``heads``.
        heads: attention heads (head size = width / heads, even, for RoPE).
        ffn: feed-forward width; ``None`` = 2 x width.
        context: trained context length written to the file, tokens (>= 16).
        seed: seeds every weight (the same spec and seed give the same bytes).

    Raises:
        ValueError: on construction, for a shape llama.cpp would reject.
    """

    layers: int = 2
    width: int = 128
    heads: int = 4
    ffn: int | None = None
    context: int = 16384
    seed: int = 0

    def __post_init__(self) -> None:
        if self.layers < 1:
            raise ValueError(f"layers must be >= 1, got {self.layers}")
        if self.heads < 1 or self.width < 1 or self.width % self.heads:
            raise ValueError(f"width ({self.width}) must be a positive multiple of heads ({self.heads})")
        if (self.width // self.heads) % 2:
            raise ValueError(f"head size width/heads = {self.width // self.heads} must be even (RoPE)")
        if self.ffn is not None and self.ffn < 1:
            raise ValueError(f"ffn must be >= 1, got {self.ffn}")
        if self.context < 16:
            raise ValueError(f"context must be >= 16 tokens, got {self.context}")

    @property
    def ffn_width(self) -> int:
        """The feed-forward width actually used."""
        return self.ffn if self.ffn is not None else 2 * self.width


def _token_table() -> tuple[list[bytes], list[float], list[int]]:
    from gguf import TokenType

    pieces: list[bytes] = [b"<unk>", b"<s>", b"</s>"]
    types: list[int] = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    for b in range(256):
        pieces.append(f"<0x{b:02X}>".encode())
        types.append(TokenType.BYTE)
    pieces.append("\u2581".encode())
    types.append(TokenType.NORMAL)
    scores = [0.0] * len(pieces)
    return pieces, scores, [int(t) for t in types]


def write_tiny_gguf(path: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write the model described by ``spec`` to ``path`` (overwritten) and return the path.

    The file is written to ``path`` + ``.tmp`` first and renamed, so a reader never sees
    half a model. Size: about 4 x (12 x width^2 x layers + 2 x 260 x width) bytes
    (float32), 1.7 MB for the defaults.

    Raises:
        ImportError: ``numpy`` or ``gguf`` is not installed (``pip install 'prefixroute[llama-cpp]'``).
        OSError: the file cannot be written.
    """
    import numpy as np
    from gguf import GGUFWriter, LlamaFileType

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(spec.seed)
    d, f = spec.width, spec.ffn_width

    def normal(shape: tuple[int, ...], std: float) -> "np.ndarray":
        return rng.normal(0.0, std, size=shape).astype(np.float32)

    tmp = path.with_name(path.name + ".tmp")
    writer = GGUFWriter(str(tmp), "llama")
    writer.add_name(f"prefixroute tiny random llama {spec.layers}x{d} seed {spec.seed}")
    writer.add_file_type(LlamaFileType.ALL_F32)
    writer.add_context_length(spec.context)
    writer.add_embedding_length(d)
    writer.add_block_count(spec.layers)
    writer.add_feed_forward_length(f)
    writer.add_head_count(spec.heads)
    writer.add_head_count_kv(spec.heads)
    writer.add_rope_dimension_count(d // spec.heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB_SIZE)

    pieces, scores, types = _token_table()
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(UNK_TOKEN)
    writer.add_bos_token_id(BOS_TOKEN)
    writer.add_eos_token_id(EOS_TOKEN)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    # numpy shape (rows, cols) is ggml's (ne1, ne0): a weight mapping d_in -> d_out is (d_out, d_in).
    writer.add_tensor("token_embd.weight", normal((VOCAB_SIZE, d), 1.0))
    for i in range(spec.layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(d, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"blk.{i}.{name}.weight", normal((d, d), d ** -0.5))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(d, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", normal((f, d), d ** -0.5))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", normal((f, d), d ** -0.5))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", normal((d, f), f ** -0.5))
    writer.add_tensor("output_norm.weight", np.ones(d, dtype=np.float32))
    # Logit of token t = output[t] . h with |h| ~ sqrt(d) after RMSNorm: printable rows
    # give logits of standard deviation ~sqrt(d) (~11 at width 128), all others exactly 0,
    # so the largest logit is a printable byte by a margin of e^-20 or more in probability.
    output = np.zeros((VOCAB_SIZE, d), dtype=np.float32)
    printable = [BYTE_TOKEN_OFFSET + b for b in range(0x20, 0x7F)]
    output[printable] = normal((len(printable), d), 1.0)
    writer.add_tensor("output.weight", output)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(path)
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m prefixroute.engines.tiny_gguf OUT [--layers N --width N ...]``."""
    p = argparse.ArgumentParser(prog="tiny_gguf", description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the .gguf file to write (overwritten)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (default: 2)")
    p.add_argument("--width", type=int, default=128, help="embedding width (default: 128)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default: 4)")
    p.add_argument("--ffn", type=int, default=None, help="feed-forward width (default: 2 x width)")
    p.add_argument("--context", type=int, default=16384, help="context length, tokens (default: 16384)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
    a = p.parse_args(argv)
    try:
        spec = TinyModelSpec(a.layers, a.width, a.heads, a.ffn, a.context, a.seed)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = write_tiny_gguf(a.out, spec)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB): {spec}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
