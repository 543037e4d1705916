"""Generate a tiny random-weight Llama checkpoint that a real vLLM can serve.

The model is meant for tests and demos of the proxy without a GPU and without any model hub:
everything (weights, tokenizer, chat template) is produced locally and deterministically from a
seed. The output directory is a regular Hugging Face model directory::

    config.json  generation_config.json  model.safetensors
    tokenizer.json  tokenizer_config.json (with the chat template)  special_tokens_map.json
    tiny_model.json    <- marker written last: parameters used, proof of completeness

Usage::

    python -m tiny_llama OUT_DIR [--seed N] [--vocab-size N] [--force]

Generation needs ``torch``, ``transformers``, ``tokenizers`` and ``safetensors`` (all of which
vLLM brings along); they are imported lazily so that this module imports without them.

Shape: 2 layers, hidden size 128, 2 attention heads (head_dim 64; vLLM's CPU attention kernel
needs head_dim >= 64), MLP size 256, byte-level BPE vocabulary of ``--vocab-size`` entries
(default 1024) trained on a small built-in corpus. The model's vocabulary size always equals the
tokenizer's, so every sampled token id decodes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

MARKER_FILE = "tiny_model.json"
FORMAT_VERSION = 1
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"
PAD_TOKEN = "<pad>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN, *ROLE_TOKENS)

# Minimal chat template. Content parts (OpenAI "content": [{"type": "text", ...}]) are flattened
# to a string by vLLM before rendering, so ``message['content']`` is always a string here.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

_WORDS = (
    "the a an of to and in is it that for on with as at by from this be are was were not or "
    "but have has had do does did will would can could should may might must shall "
    "model engine proxy server request response token tokens stream chunk usage prompt "
    "completion chat message system user assistant content role health ready start stop "
    "sleep wake load unload memory cache kv gpu cpu port host process group signal queue "
    "pool instance backend frontend route latency throughput batch sequence length limit "
    "time second minute hour day week year number value field name label metric counter "
    "hello world good morning thanks please yes no maybe okay sure question answer reason "
    "red green blue black white small large tiny huge fast slow early late first last "
    "one two three four five six seven eight nine ten hundred thousand million "
    "cat dog bird fish tree river mountain city road house door window table chair book "
    "write read open close send receive accept reject retry wait poll kill spawn serve"
).split()

_PUNCT = (".", ",", "!", "?", ":", ";", "-", "(", ")", '"', "'", "\n")


@dataclass(frozen=True)
class TinyModelSpec:
    """Parameters of the generated model; stored in the marker file."""

    seed: int = 0
    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    max_position_embeddings: int = 2048
    format_version: int = FORMAT_VERSION

    def validate(self) -> None:
        if self.num_attention_heads <= 0 or self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        if self.hidden_size // self.num_attention_heads < 64:
            raise ValueError("head_dim (hidden_size / num_attention_heads) must be >= 64")
        min_vocab = 256 + len(SPECIAL_TOKENS)
        if self.vocab_size < min_vocab:
            raise ValueError(f"vocab_size must be >= {min_vocab} (byte alphabet + specials)")
        if self.num_hidden_layers < 1 or self.intermediate_size < 1:
            raise ValueError("num_hidden_layers and intermediate_size must be positive")
        if self.max_position_embeddings < 16:
            raise ValueError("max_position_embeddings must be >= 16")


def _corpus(seed: int, n_lines: int = 3000) -> Iterator[str]:
    """A small deterministic pseudo-English corpus for training the BPE tokenizer."""
    rng = random.Random(seed)
    digits = "0123456789"
    for _ in range(n_lines):
        parts: list[str] = []
        for _ in range(rng.randint(4, 16)):
            r = rng.random()
            if r < 0.8:
                word = rng.choice(_WORDS)
                parts.append(word.capitalize() if rng.random() < 0.1 else word)
            elif r < 0.9:
                parts.append("".join(rng.choice(digits) for _ in range(rng.randint(1, 4))))
            else:
                parts.append(rng.choice(_PUNCT))
        yield " ".join(parts)


def _build_tokenizer(spec: TinyModelSpec) -> Any:
    """Train a byte-level BPE tokenizer and wrap it in ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec.seed), trainer=trainer)

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=list(ROLE_TOKENS),
        model_max_length=spec.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _write_model(spec: TinyModelSpec, tokenizer: Any, out: Path) -> None:
    """Create a random Llama whose vocabulary matches ``tokenizer`` and save it to ``out``.

    Weights are stored as bfloat16, the dtype vLLM's CPU backend runs in anyway (a float32
    checkpoint is downcast with one warning per tensor).
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    vocab_size = len(tokenizer)
    bos_id = tokenizer.convert_tokens_to_ids(BOS_TOKEN)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    # Plain kwargs dict: transformers 4.x takes ``rope_theta`` directly, 5.x folds it into
    # ``rope_parameters``; a dict keeps type checkers quiet with either stub set.
    config_kwargs: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_attention_heads,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
    }
    config = LlamaConfig(**config_kwargs)
    torch.manual_seed(spec.seed)
    with torch.no_grad():
        model: Any = LlamaForCausalLM(config)
        model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id
    )
    with contextlib.suppress(Exception):  # no "Writing model shards" progress bar
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    model.save_pretrained(str(out), safe_serialization=True)


def _marker_payload(spec: TinyModelSpec) -> dict[str, Any]:
    return {"generator": "tiny_llama", **asdict(spec)}


def read_marker(path: str | Path) -> dict[str, Any] | None:
    """Return the marker of a generated model directory, or None if absent/unreadable."""
    try:
        data = json.loads((Path(path) / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_complete(path: str | Path, spec: TinyModelSpec | None = None) -> bool:
    """True if ``path`` holds a complete generated model (matching ``spec`` when given)."""
    p = Path(path)
    marker = read_marker(p)
    if marker is None or not all((p / name).is_file() for name in REQUIRED_FILES):
        return False
    return spec is None or marker == _marker_payload(spec)


def _tokenizer_config(spec: TinyModelSpec, tokenizer: Any) -> dict[str, Any]:
    """``tokenizer_config.json`` in a form that transformers 4.x and 5.x both load.

    (transformers 5 would otherwise write ``TokenizersBackend`` and a separate
    ``chat_template.jinja``, which 4.x cannot read.)
    """
    added = {
        str(tokenizer.convert_tokens_to_ids(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": UNK_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": list(ROLE_TOKENS),
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }


def _generate_into(spec: TinyModelSpec, out: Path) -> None:
    tokenizer = _build_tokenizer(spec)
    tokenizer.save_pretrained(str(out))
    (out / "chat_template.jinja").unlink(missing_ok=True)
    (out / "tokenizer_config.json").write_text(
        json.dumps(_tokenizer_config(spec, tokenizer), indent=2) + "\n"
    )
    special_map = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": UNK_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": list(ROLE_TOKENS),
    }
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    _write_model(spec, tokenizer, out)
    missing = [name for name in REQUIRED_FILES if not (out / name).is_file()]
    if missing:
        raise RuntimeError(f"generation did not produce {missing}")
    _fix_permissions(out)
    # Marker last: its presence means "complete".
    (out / MARKER_FILE).write_text(json.dumps(_marker_payload(spec), indent=2) + "\n")


def _fix_permissions(out: Path) -> None:
    """mkdtemp creates 0700 and some writers 0600: make the result world-readable (umask)."""
    umask = os.umask(0)
    os.umask(umask)
    out.chmod(0o755 & ~umask)
    for f in out.iterdir():
        f.chmod(0o644 & ~umask)


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def generate(path: str | Path, spec: TinyModelSpec | None = None, force: bool = False) -> Path:
    """Generate the model into ``path`` unless a complete one with the same spec is there.

    The files are written into a temporary sibling directory which is then renamed into place,
    so a reader never sees a half-written model. An existing directory is replaced only if it is
    empty or is itself a generated model (with other parameters, or ``force``); anything else is
    left alone and ``FileExistsError`` is raised.
    """
    spec = spec or TinyModelSpec()
    spec.validate()
    out = Path(path).expanduser().absolute()
    if not force and is_complete(out, spec):
        return out
    if out.exists() and not _is_empty_dir(out) and read_marker(out) is None:
        raise FileExistsError(f"{out} exists and is not a generated tiny model; not replacing it")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    trash: Path | None = None
    try:
        _generate_into(spec, tmp)
        if not force and is_complete(out, spec):  # another process won the race
            return out
        if out.exists() and not _is_empty_dir(out):
            trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, trash / "model")
        try:
            os.replace(tmp, out)  # atomic; also replaces an empty directory
        except OSError:
            if is_complete(out, spec):  # concurrent generator finished first
                return out
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
    return out


def ensure_tiny_model(path: str | Path, seed: int = 0) -> Path:
    """Return ``path`` after making sure it holds the default tiny model for ``seed``."""
    return generate(path, TinyModelSpec(seed=seed))


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    d = TinyModelSpec()
    ap = argparse.ArgumentParser(
        prog="python -m tiny_llama",
        description="Generate a tiny random-weight Llama (with tokenizer) servable by vLLM.",
    )
    ap.add_argument("out_dir", help="output model directory")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--vocab-size", type=int, default=d.vocab_size)
    ap.add_argument("--hidden-size", type=int, default=d.hidden_size)
    ap.add_argument("--intermediate-size", type=int, default=d.intermediate_size)
    ap.add_argument("--num-layers", type=int, default=d.num_hidden_layers)
    ap.add_argument("--num-heads", type=int, default=d.num_attention_heads)
    ap.add_argument("--max-position-embeddings", type=int, default=d.max_position_embeddings)
    ap.add_argument("--force", action="store_true", help="regenerate even if complete")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    spec = TinyModelSpec(
        seed=args.seed,
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        max_position_embeddings=args.max_position_embeddings,
    )
    started = time.monotonic()
    try:
        spec.validate()
        if not args.force and is_complete(args.out_dir, spec):
            print(f"{Path(args.out_dir).absolute()}: already complete, nothing to do")
            return 0
        out = generate(args.out_dir, spec, force=args.force)
    except (ValueError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with contextlib.suppress(OSError):
        vocab = json.loads((out / "config.json").read_text()).get("vocab_size")
        print(f"vocab_size={vocab}")
    print(f"{out}: generated in {time.monotonic() - started:.1f}s")
    return 0
