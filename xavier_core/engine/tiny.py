"""Writes deterministic random-weight checkpoints with a real byte-level BPE tokenizer.

`make_tiny` is what the tests, `xavier up` and the benchmarks use instead of downloading a model: the same
seed and shape always give byte-identical files, and the shape can be set to a real model's (for example
Qwen2.5-0.5B's) so GPU benchmarks move real amounts of memory.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from xavier_core.engine.checkpoint import ModelConfig, RopeConfig, expected_shapes
from xavier_core.engine.errors import CheckpointError

ARCHS = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# ChatML; with `tools`, a system turn lists them and asks for Qwen2.5's (Hermes') `<tool_call>` form, and
# an assistant turn's tool calls are written in it. Without tools it renders exactly as plain ChatML.
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n# Tools\\n\\nYou may call one or more functions. Their "
    "signatures are within <tools></tools>:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nFor each call, return a JSON object with the function name and arguments "
    'within <tool_call></tool_call> tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{% for call in message.tool_calls or [] %}"
    '{{ \'\\n<tool_call>\\n{"name": "\' + call.function.name + \'", "arguments": \' '
    "+ (call.function.arguments | tojson) + '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
QWEN25_05B = {
    "layers": 24,
    "hidden": 896,
    "heads": 14,
    "kv_heads": 2,
    "intermediate": 4864,
    "vocab": 151936,
    "max_position": 32768,
}
WIDTH_7B = {
    "layers": 4,
    "hidden": 3584,
    "heads": 28,
    "kv_heads": 4,
    "intermediate": 18944,
    "vocab": 152064,
    "max_position": 32768,
}
"""Qwen2.5-7B's width (hidden, heads, KV heads, MLP, vocabulary) at 4 of its 28 layers: per layer the
same ratio of prefill compute to KV bytes as the whole model."""
SHAPES: dict[str, dict[str, int]] = {"qwen2.5-0.5b": QWEN25_05B, "7b-width": WIDTH_7B}
"""The benchmarks' named model shapes (`make_tiny` sizes); any other name is the tiny default."""


def shape_sizes(shape: str, layers: int = 0) -> dict[str, int]:
    """The `make_tiny` sizes of a named shape (`SHAPES`; any other name: {}, the tiny default), with
    `layers` layers instead of its own when given."""
    sizes = dict(SHAPES.get(shape, {}))
    if layers:
        sizes["layers"] = layers
    return sizes


_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Once upon a time there was a small village by the sea, where the fishermen went out every morning.
The weather today is sunny with a light breeze from the west, and the temperature will reach twenty degrees.
Machine learning models learn patterns from data; a language model predicts the next word in a sentence.
Please write a short story about a robot who learns to paint pictures of the mountains at sunset.
What is the capital of France? The capital of France is Paris, a city known for art and food.
Numbers: one, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve, 2024, 3.14, 42.
She sells sea shells by the sea shore, and the shells she sells are surely sea shells.
In the beginning the universe was created. This has made a lot of people very angry.
To be, or not to be, that is the question: whether it is nobler in the mind to suffer.
The server accepts requests over gRPC, streams tokens back, and shares cached pages with its peers.
Good morning! How are you doing today? I am fine, thank you, and I hope you are well too.
Water boils at one hundred degrees Celsius at sea level and freezes at zero degrees.
The library opens at nine in the morning and closes at six in the evening, except on Sundays.
Cats and dogs are popular pets; some people prefer birds, fish, rabbits or even snakes.
He opened the door slowly, looked around the empty room, and wondered where everyone had gone.
Explain the difference between a list and a tuple in Python, with a simple example of each.
Über café naïve résumé — “quotes”, ellipsis… and emoji 🙂 test the byte-level fallback.
"""


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """Trains a byte-level BPE tokenizer on the embedded corpus (deterministic for a given size)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines() * 4, trainer=trainer)
    return tok


def tiny_config(
    arch: str,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    vocab: int,
    max_position: int,
    tie_word_embeddings: bool,
) -> ModelConfig:
    """The `ModelConfig` `make_tiny` writes, validated the same way a loaded config is."""
    if arch not in ARCHS:
        raise CheckpointError(f"unknown arch {arch!r} (choose from {', '.join(ARCHS)})")
    if hidden % heads or heads % kv_heads or (hidden // heads) % 2:
        raise CheckpointError(f"hidden {hidden}, heads {heads}, kv_heads {kv_heads} do not divide evenly")
    return ModelConfig(
        arch=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hidden // heads,
        intermediate_size=intermediate,
        rms_norm_eps=1e-6,
        rope=RopeConfig(theta=1_000_000.0 if arch != "llama" else 500_000.0),
        max_position=max_position,
        tie_word_embeddings=tie_word_embeddings,
        attention_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
    )


def _config_json(cfg: ModelConfig, bos: int, eos: int, dtype: str) -> dict[str, object]:
    return {
        "architectures": [ARCHS[cfg.arch]],
        "model_type": cfg.arch,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope.theta,
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "use_sliding_window": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": dtype,
    }


def _init_weights(cfg: ModelConfig, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    # Linear weights ~ N(0, 1/fan_in) keep activations O(1) through many layers (fp16 safe); norm
    # weights and biases get noise so that a wrong norm or a dropped bias shows up in the logits.
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith(".bias"):
            t = 0.1 * torch.randn(shape, generator=gen)
        elif name == "model.embed_tokens.weight":
            # Small enough that the layers, not the input token's own (tied) embedding, drive the logits.
            t = 0.3 * torch.randn(shape, generator=gen)
        else:
            t = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
        out[name] = t.to(dtype).contiguous()
    return out


def make_tiny(
    directory: str | Path,
    arch: str,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    vocab: int = 512,
    max_position: int = 4096,
    seed: int = 0,
    dtype: str = "float32",
    tie_word_embeddings: bool | None = None,
    shards: int = 1,
) -> Path:
    """Writes a random-weight checkpoint of `arch` into `directory` and returns its path.

    Files: config.json, generation_config.json, model.safetensors (or `shards` shards with an index),
    tokenizer.json (byte-level BPE with at most `vocab` entries) and tokenizer_config.json (ChatML template,
    eos `<|im_end|>`). Embeddings are tied by default for qwen2/qwen3, as in the small Qwen models.
    """
    if dtype not in ("float32", "float16", "bfloat16"):
        raise CheckpointError(f"unsupported dtype {dtype!r}")
    tied = arch != "llama" if tie_word_embeddings is None else tie_word_embeddings
    cfg = tiny_config(arch, layers, hidden, heads, kv_heads, intermediate, vocab, max_position, tied)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(min(vocab, 8192))
    tok.save(str(out / "tokenizer.json"))
    bos, eos = SPECIAL_TOKENS.index("<|endoftext|>"), SPECIAL_TOKENS.index("<|im_end|>")  # trained first
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[2],
        "pad_token": SPECIAL_TOKENS[0],
        "add_bos_token": False,
        "model_max_length": max_position,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(_config_json(cfg, bos, eos, dtype), indent=2) + "\n")
    gen_cfg = {"bos_token_id": bos, "eos_token_id": [eos, bos], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    _write_weights(out, _init_weights(cfg, seed, getattr(torch, dtype)), shards)
    return out


def _write_weights(out: Path, weights: dict[str, torch.Tensor], shards: int) -> None:
    meta = {"format": "pt"}
    if shards <= 1:
        save_file(weights, str(out / "model.safetensors"), metadata=meta)
        return
    names = list(weights)
    per = math.ceil(len(names) / shards)
    weight_map: dict[str, str] = {}
    for i in range(shards):
        part = names[i * per : (i + 1) * per]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: weights[n] for n in part}, str(out / fname), metadata=meta)
        weight_map.update(dict.fromkeys(part, fname))
    total = sum(t.numel() * t.element_size() for t in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def make_tiny_main(argv: Sequence[str] | None = None) -> int:
    """CLI: `xavier models make-tiny DIR --arch qwen2|qwen3|llama [--shape qwen2.5-0.5b] [sizes...]`."""
    p = argparse.ArgumentParser(prog="xavier models make-tiny", description=make_tiny.__doc__)
    p.add_argument("dir")
    p.add_argument("--arch", choices=sorted(ARCHS), default="qwen2")
    p.add_argument("--shape", choices=["tiny", "qwen2.5-0.5b"], default="tiny")
    for flag in ("layers", "hidden", "heads", "kv-heads", "intermediate", "vocab", "max-position"):
        p.add_argument(f"--{flag}", type=int, default=None)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shards", type=int, default=1)
    args = p.parse_args(argv)
    sizes: dict[str, int] = dict(QWEN25_05B) if args.shape == "qwen2.5-0.5b" else {}
    for key in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "max_position"):
        if getattr(args, key) is not None:
            sizes[key] = getattr(args, key)
    dtype = args.dtype or ("float16" if args.shape == "qwen2.5-0.5b" else "float32")
    path = make_tiny(
        args.dir,
        args.arch,
        layers=sizes.get("layers", 2),
        hidden=sizes.get("hidden", 64),
        heads=sizes.get("heads", 4),
        kv_heads=sizes.get("kv_heads", 2),
        intermediate=sizes.get("intermediate", 128),
        vocab=sizes.get("vocab", 512),
        max_position=sizes.get("max_position", 4096),
        seed=args.seed,
        dtype=dtype,
        shards=args.shards,
    )
    print(path)
    return 0
