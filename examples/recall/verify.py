"""The whole trained model through ``nanoattn.verify``: causality on token ids,
padding (through the model's ``valid`` mask), and its KV-cache decoding against its
own full forward (``check_decoding`` with ``decoders.nnx``: the model has the NNX
layer's decode API, so the adapter takes it as it is)."""

import jax
from flax import nnx

from nanoattn.verify import Report, check_causality, check_decoding, check_padding, decoders

from .model import Decoder


def verify(model: Decoder, *, seq_lens=None, decode_len: int = 13) -> list[Report]:
    """The three reports on ``model`` in evaluation mode (dropout off): causality at
    ``seq_lens`` (default: the check's own, 1 to 513 tokens), padding, and decoding
    ``decode_len`` tokens."""
    model = nnx.clone(model)
    model.eval()
    graphdef, state = nnx.split(model)
    vocab = model.config.vocab

    def logits(tokens):  # (B, T) int -> (B, T, V)
        return nnx.merge(graphdef, state)(tokens)

    def padded_logits(tokens, valid):  # valid (B, T) bool: True at real tokens
        return nnx.merge(graphdef, state)(tokens, valid=valid)

    causal = {} if seq_lens is None else {"seq_lens": tuple(seq_lens)}
    return [
        check_causality(logits, vocab=vocab, **causal),
        check_padding(jax.jit(padded_logits), vocab=vocab),
        check_decoding(*decoders.nnx(model), vocab=vocab, seq_len=decode_len),
    ]
