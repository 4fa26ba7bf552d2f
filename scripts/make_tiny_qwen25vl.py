#!/usr/bin/env python3
"""Write a tiny, randomly initialised Qwen2.5-VL checkpoint that a real `vllm serve` loads.

    PY="$(dirname "$(scripts/reference_env.sh | tail -n1)")/python"
    "$PY" scripts/make_tiny_qwen25vl.py OUT_DIR [--seed 0] [--dtype bfloat16] [--no-check]

Offline, deterministic (fixed seeds: the same bytes on every run with the same reference env),
a few seconds. Runs with the reference env's python (scripts/reference_env.sh): it needs torch,
transformers 5.x and tokenizers, and nothing from the project.

The text it generates is garbage (random weights), but everything a reward proxy relies on is
real: the launch flags, Qwen2-VL's conversation format, the multimodal processor and its token
counts, usage.prompt_tokens, structured outputs, logprobs, n, seeds, error bodies. What follows
the real model on purpose:
  * vision: patch 14, spatial merge 2, temporal patch 2, so a video of T frames at HxW costs
    ceil(T/2)*(H/28)*(W/28) tokens and an image (H/28)*(W/28), each wrapped in
    <|vision_start|> ... <|vision_end|>, exactly as for Qwen2.5-VL-7B.
  * the special tokens and their order (<|endoftext|> first, ... <|video_pad|>) appended after a
    small byte-level BPE trained here with the `tokenizers` library; config ids match them.
  * the chat template produces Qwen2-VL's format, including the default system prompt
    "You are a helpful assistant." when the first message is not a system message.
  * image and video processors: Qwen2VLImageProcessor / Qwen2VLVideoProcessor with
    min_pixels 3136 (transformers' video default, 128*28*28, would upscale the proxy's 224x224
    frames and change the token count) and max_pixels 12845056.
  * generation_config.json carries Qwen2.5-VL-7B-Instruct's sampling defaults, so a request that
    omits a sampling field gets them from `--generation-config auto`, as with the real model.
What is tiny: 2 text layers (hidden 128, 2 heads of 64: the CPU attention backend takes head
sizes 32, 64, 80, ...; mrope_section [8, 12, 12] sums to head_dim/2 as vLLM asserts), 2 vision
blocks (hidden 128), a ~750-token vocabulary; ~1.3 M parameters, ~2.7 MB.

OUT_DIR is replaced as a whole (written to a temporary sibling, then renamed into place); an
existing OUT_DIR must be empty or an earlier output of this script, anything else is refused.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

# Offline and quiet, before transformers is imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

# Qwen2-VL's special tokens, in Qwen's order (the real ids are 151643 + index).
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
    "<|quad_start|>", "<|quad_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
MIN_PIXELS = 3136           # 4 * 28 * 28: never upscale frames the proxy already sized
MAX_PIXELS = 12845056       # 16384 * 28 * 28, Qwen2.5-VL's own image max_pixels
BPE_VOCAB_SIZE = 2048       # before the special tokens
VOCAB_MULTIPLE = 64         # the embedding is padded, like the real model's 151936 rows

# Qwen2-VL's conversation format, written as a Jinja template. It loops over
# message['content'] parts, so vLLM passes OpenAI-style parts ({"type": "image"}, {"type":
# "video"}, {"type": "text", "text": ...}) to it.
CHAT_TEMPLATE = (
    "{%- set image_count = namespace(value=0) -%}"
    "{%- set video_count = namespace(value=0) -%}"
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' or part['type'] == 'image_url' or 'image' in part or 'image_url' in part -%}"
    "{%- set image_count.value = image_count.value + 1 -%}"
    "{%- if add_vision_id -%}{{- 'Picture ' ~ image_count.value ~ ': ' -}}{%- endif -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' or part['type'] == 'video_url' or 'video' in part or 'video_url' in part -%}"
    "{%- set video_count.value = video_count.value + 1 -%}"
    "{%- if add_vision_id -%}{{- 'Video ' ~ video_count.value ~ ': ' -}}{%- endif -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif 'text' in part -%}"
    "{{- part['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Pre-tokenisation: letters with an optional leading non-letter, single digits (as Qwen does),
# punctuation runs, newlines, spaces. Byte-level, so every string encodes.
PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_WORD_TEXT = (
    "the a an robot arm gripper task episode frame frames video image camera view scene table "
    "object objects block cup bowl plate drawer door stove microwave basket mug pot put pick place "
    "open close push pull turn on off left right top bottom front back of in into onto to from "
    "with and or is are was were has have been not yet now then after before during while "
    "progress score reward success failure complete completed completion percent stage step "
    "steps goal state initial current final first last how far along what much does show shows "
    "answer think planning observation reasoning estimate please output number between only "
    "you are helpful assistant model judge evaluate video given describe carefully"
)
_WORDS = _WORD_TEXT.split()


def _corpus(seed: int) -> list[str]:
    """A deterministic, made-up training corpus for the BPE: English-ish lines, tags, numbers."""
    rng = random.Random(seed)
    lines = [
        DEFAULT_SYSTEM_PROMPT,
        "<think><planning>...</planning><observation>...</observation><reasoning>...</reasoning></think>",
        "<answer>0</answer> <answer>50</answer> <answer>100</answer> <score>75</score>",
    ]
    lines += [f"<answer>{i}</answer> {i}% {i / 100:.2f}" for i in range(101)]
    # the answer words of the shipped field methods (prompts/topreward.yaml, roboreward.yaml), often
    # enough that each is ONE token, as in Qwen's vocabulary: a probability answer is one token's
    lines += [f"{word}. The answer is: {word}" for word in ("True", "False") for _ in range(60)]
    lines += [f"ANSWER: {score}" for score in range(1, 6) for _ in range(12)]
    for _ in range(3000):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 100)))
        line = " ".join(words)
        lines.append(line[0].upper() + line[1:] + rng.choice([".", "?", "!", ":", ",", ""]))
    return lines


def build_tokenizer(seed: int):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE, min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[],
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    base = tok.get_vocab_size()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    expected = {t: base + i for i, t in enumerate(SPECIAL_TOKENS)}
    if ids != expected:
        raise SystemExit(f"special token ids {ids} are not {expected}")
    return tok, ids


def build_config(ids: dict[str, int], vocab_size: int, dtype: str):
    from transformers import Qwen2_5_VLConfig

    text_hidden, head_dim = 128, 64
    text_config = {
        "vocab_size": vocab_size,
        "hidden_size": text_hidden,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": text_hidden // head_dim,
        "num_key_value_heads": 1,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "use_sliding_window": False,
        "max_window_layers": 2,
        "attention_dropout": 0.0,
        # mrope: temporal/height/width sections of the rotary half-dimension (head_dim/2 = 32)
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [8, 12, 12]},
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "dtype": dtype,
    }
    assert sum(text_config["rope_parameters"]["mrope_section"]) == head_dim // 2
    vision_config = {
        "depth": 2,
        "hidden_size": 128,
        "num_heads": 2,
        "intermediate_size": 256,
        "hidden_act": "silu",
        "in_channels": 3,
        "patch_size": 14,              # as Qwen2.5-VL: token counts follow the real formulas
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "tokens_per_second": 2,
        "window_size": 112,
        "fullatt_block_indexes": [1],
        "out_hidden_size": text_hidden,
        "initializer_range": 0.02,
    }
    return Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        dtype=dtype,
    )


def generation_config(ids: dict[str, int]) -> dict:
    # Qwen2.5-VL-7B-Instruct's published defaults, with this tokenizer's ids.
    return {
        "bos_token_id": ids["<|endoftext|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "do_sample": True,
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "repetition_penalty": 1.05,
        "temperature": 0.1,
        "top_p": 0.001,
        "top_k": 1,
    }


def _check_replaceable(out: Path) -> None:
    """Only an empty directory or an earlier output of this script may be replaced."""
    if not out.exists():
        return
    if not out.is_dir():
        raise SystemExit(f"{out} exists and is not a directory")
    if not any(out.iterdir()):
        return
    try:
        cfg = json.loads((out / "config.json").read_text())
        ours = cfg.get("model_type") == "qwen2_5_vl" and cfg["text_config"]["vocab_size"] < 10_000
    except (OSError, ValueError, KeyError, TypeError):
        ours = False
    if not ours:
        raise SystemExit(f"{out} is not empty and is not a tiny Qwen2.5-VL made by this script; refusing to replace it")


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def self_check(out: Path, ids: dict[str, int]) -> str:
    """Load the directory back like vLLM does (AutoConfig/AutoProcessor) and count tokens."""
    import numpy as np
    from transformers import AutoConfig, AutoProcessor

    cfg = AutoConfig.from_pretrained(out)
    proc = AutoProcessor.from_pretrained(out)
    tok = proc.tokenizer
    for name, key in (("<|image_pad|>", "image_token_id"), ("<|video_pad|>", "video_token_id"),
                      ("<|vision_start|>", "vision_start_token_id"), ("<|vision_end|>", "vision_end_token_id")):
        assert tok.convert_tokens_to_ids(name) == getattr(cfg, key) == ids[name], (name, key)
    msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "How far?"}]}]
    text = proc.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    want = ("<|im_start|>system\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\n<|im_start|>user\n"
            "<|vision_start|><|video_pad|><|vision_end|>How far?<|im_end|>\n<|im_start|>assistant\n")
    assert text == want, repr(text)
    video = np.zeros((4, 224, 336, 3), dtype=np.uint8)   # 4 frames -> 2 temporal patches
    image = np.zeros((224, 224, 3), dtype=np.uint8)
    enc = proc(text=[text], videos=[video], return_tensors="np")
    n_video = int((enc["input_ids"] == ids["<|video_pad|>"]).sum())
    assert n_video == 2 * (224 // 28) * (336 // 28), n_video
    enc = proc(text=["<|vision_start|><|image_pad|><|vision_end|>"], images=[image], return_tensors="np")
    n_image = int((enc["input_ids"] == ids["<|image_pad|>"]).sum())
    assert n_image == (224 // 28) ** 2, n_image
    return f"4x224x336 video -> {n_video} tokens, 224x224 image -> {n_image} tokens"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--no-check", action="store_true", help="skip loading the result back")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()

    import torch
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    final: Path = args.out_dir.resolve()
    _check_replaceable(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))

    tok, ids = build_tokenizer(args.seed)
    n_tokens = tok.get_vocab_size()
    vocab_size = -(-n_tokens // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=SPECIAL_TOKENS[3:],
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
        chat_template=CHAT_TEMPLATE,
    )

    config = build_config(ids, vocab_size, args.dtype)
    with torch.no_grad():
        model = Qwen2_5_VLForConditionalGeneration(config)
        model = model.to(getattr(torch, args.dtype)).eval()
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out, safe_serialization=True)
    write_json(out / "generation_config.json", generation_config(ids))

    common = dict(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=14, temporal_patch_size=2,
                  merge_size=2)
    # The layout of the real checkpoints: preprocessor_config.json (image processor),
    # video_preprocessor_config.json, tokenizer files, chat_template.jinja; AutoProcessor (what
    # vLLM calls) assembles Qwen2_5_VLProcessor from them via config.json's model_type.
    image_processor = Qwen2VLImageProcessor(**common)
    video_processor = Qwen2VLVideoProcessor(**common, do_sample_frames=False, cap_pixels_per_frame=False)
    image_processor.save_pretrained(out)
    video_processor.save_pretrained(out)
    hf_tok.save_pretrained(out)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    for name in ("preprocessor_config.json", "video_preprocessor_config.json", "tokenizer_config.json"):
        data = json.loads((out / name).read_text())
        data["processor_class"] = "Qwen2_5_VLProcessor"
        if name != "tokenizer_config.json":
            data["min_pixels"], data["max_pixels"] = MIN_PIXELS, MAX_PIXELS  # same as size.*_edge
        write_json(out / name, data)
    for path in out.iterdir():
        path.chmod(0o644)
    build_s = time.perf_counter() - t0

    check = "skipped"
    try:
        if not args.no_check:
            check = self_check(out, ids)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    out.chmod(0o755)
    if final.exists():
        shutil.rmtree(final)
    os.replace(out, final)
    out = final

    files = sorted(p for p in out.iterdir() if p.is_file())
    total = sum(p.stat().st_size for p in files)
    digest = hashlib.sha256()
    for p in files:
        digest.update(p.name.encode() + b"\0" + p.read_bytes())
    print(f"tiny Qwen2.5-VL written to {out.resolve()}")
    print(f"  parameters: {n_params:,} ({args.dtype}); vocab {n_tokens} tokens, embedding rows {vocab_size}")
    print("  special ids: " + ", ".join(f"{t}={ids[t]}" for t in SPECIAL_TOKENS if "ref" not in t
                                         and "box" not in t and "quad" not in t))
    print(f"  files: {', '.join(p.name for p in files)}")
    print(f"  size: {total / 1e6:.2f} MB in {len(files)} files; sha256 of all files: {digest.hexdigest()[:16]}")
    print(f"  self-check: {check}")
    print(f"  time: {build_s:.1f}s to build, {time.perf_counter() - t0:.1f}s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
