"""Layer 1: small Qwen3 models (dense and MoE, with routing record/replay hooks), tandem's tokenizer and its
token-exact chat / tool-call format."""

from tandem.model.build import build_model, num_params, qwen3_config
from tandem.model.chat import CHAT_TEMPLATE, SPECIAL_TOKENS, ChatTemplate, render_text
from tandem.model.load import load_chat_format, load_model, load_tokenizer
from tandem.model.moe import RouterHooks, moe_shape, write_model_dir
from tandem.model.tokenizer import save_tokenizer, train_tokenizer

__all__ = [
    "CHAT_TEMPLATE",
    "RouterHooks",
    "SPECIAL_TOKENS",
    "ChatTemplate",
    "build_model",
    "load_chat_format",
    "load_model",
    "load_tokenizer",
    "moe_shape",
    "num_params",
    "qwen3_config",
    "render_text",
    "save_tokenizer",
    "train_tokenizer",
    "write_model_dir",
]
