"""Train and save tandem's byte-level BPE tokenizer as an HF fast tokenizer that loads offline.

Invariants: byte-level (every string round-trips through encode/decode); no prefix space and no BOS/EOS added
by ``encode``; the five special tokens of ``tandem.model.chat.SPECIAL_TOKENS`` get ids 0..4 in that order
(``<|endoftext|>`` = 0 is eos and pad); the saved directory carries the Jinja chat template that renders
the same text as ``tandem.model.chat.render_text``; training is deterministic for a given text sample.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tandem.model.chat import CHAT_TEMPLATE, EOT, IM_END, IM_START, SPECIAL_TOKENS


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096, min_frequency: int = 2):  # -> Tokenizer
    """Train a byte-level BPE with tandem's special tokens on ``texts``; a ``tokenizers.Tokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size} is below 256 bytes + {len(SPECIAL_TOKENS)} special tokens")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok, out_dir: str | Path, model_max_length: int = 1024) -> Path:  # tok: Tokenizer
    """Save ``tok`` as an HF ``PreTrainedTokenizerFast`` dir (tokenizer.json, config, chat template)."""
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOT,
        pad_token=EOT,
        additional_special_tokens=[s for s in SPECIAL_TOKENS if s != EOT],
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(str(out))
    # The generic class name loads in transformers 4.x as well as 5.x.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    return out


def check_tokenizer(tok) -> None:
    """Raise ValueError unless the special tokens have the ids the module invariants promise."""
    for i, s in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(s) != i:
            raise ValueError(f"special token {s!r} has id {tok.token_to_id(s)}, expected {i}")
    for s in (IM_START, IM_END):
        if len(tok.encode(s).ids) != 1:
            raise ValueError(f"{s!r} does not encode to one token")
