"""Build a tiny random Llama and a locally trained tokenizer for the real-vLLM test tier.

Run by the vLLM venv's python (it needs torch, tokenizers and transformers): the machines here have
no model hub, so the model is made from nothing. Random weights are fine: the tests exercise vLLM's
serving behaviour (SSE, metrics, drain), not text quality. Deterministic for a given Python version.

usage: python make_tiny_model.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
# Training text that every machine has: the interpreter's own stdlib sources, a bounded sorted subset.
TRAINING_FILES = 200
# vLLM's CPU attention only supports head sizes 32, 64, 80, ... so head_dim 32 is the floor.
HEAD_DIM = 32
# Long enough for --max-model-len 8192 with room, so drain tests can hold multi-second streams.
MAX_POSITIONS = 16384
# ChatML: a plain template the chat endpoint can render without any hub files.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' "
    "+ (message['content'] if message['content'] is string else '') + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def training_texts() -> Iterator[str]:
    """Yield stdlib source files in a fixed order so the vocabulary is reproducible."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py"))[:TRAINING_FILES]:
        yield path.read_text(encoding="utf-8", errors="ignore")


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Train a byte-level BPE (no unknown bytes, so any prompt tokenizes)."""
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(training_texts(), trainer=trainer)
    bos_id = bpe.token_to_id("<s>")
    bpe.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="</s>",
        model_max_length=MAX_POSITIONS,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_portable(out_dir: Path) -> None:
    """Let older transformers (used by load clients) read the tokenizer config too.

    transformers 5 writes tokenizer_class "TokenizersBackend" and keeps the template only in
    chat_template.jinja; 4.x needs the fast class name and the template inline.
    """
    config_path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def build_model(tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> int:
    """Save a 2-layer random Llama sized for the tokenizer; returns its parameter count."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out_dir, safe_serialization=True)
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(out_dir)
    return sum(parameter.numel() for parameter in model.parameters())


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out_dir = Path(argv[1])
    started = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(out_dir)
    make_portable(out_dir)
    parameters = build_model(tokenizer, out_dir)
    took = time.perf_counter() - started
    print(f"tiny model: vocab={len(tokenizer)} params={parameters} dir={out_dir} [{took:.1f} s]")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
