"""Build a small Llama model for real-engine tests, with no hub access.

    python ci/make_model.py --preset tiny|tiny-long|bench --out DIR [--tokenizer-only]

Run it with the vLLM venv's python (ci/vllm_venv.sh prints it). It trains a byte-level BPE
tokenizer with `tokenizers` on the Python stdlib sources (sorted paths, a fixed byte budget),
wraps it as a `PreTrainedTokenizerFast` with bos/eos/pad tokens and a plain chat template, and
saves a `LlamaForCausalLM` with random weights drawn from a fixed seed as safetensors.
``--tokenizer-only`` writes the tokenizer and its chat template alone, which needs no torch: what
the router's tests and ``pof bench router-overhead`` (stand-in engines) read of a model.

The output is deterministic for a given Python version (the corpus is its stdlib) and the
pinned transformers/tokenizers/torch versions: the same command writes byte-identical files.
A marker file records preset, seed and script version; when DIR already holds a matching
build, nothing is done. The build happens in a sibling temp dir and is renamed into place.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

SCRIPT_VERSION = 1
MARKER = "pof-model.json"
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}" + EOS + "\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    vocab_size: int  # BPE training target; the model's vocab is len(tokenizer)
    dtype: str
    corpus_bytes: int
    seed: int


# Head size = hidden / heads must be one the CPU attention backend accepts (32, 64, 80, ...).
# bf16 for both: vLLM's dtype "auto" downcasts float32 checkpoints to bf16 anyway.
PRESETS: dict[str, Preset] = {
    "tiny": Preset(128, 256, 2, 4, 2, 4096, 2000, "bfloat16", 2 << 20, 1234),
    # tiny's weights (same shapes and seed) with a 32K-token context, for long-context sessions
    # (`pof bench capacity --trace docs/traces/long-context.jsonl`).
    "tiny-long": Preset(128, 256, 2, 4, 2, 32768, 2000, "bfloat16", 2 << 20, 1234),
    "bench": Preset(1024, 2816, 8, 16, 4, 16384, 8000, "bfloat16", 8 << 20, 4321),
}


def corpus(limit: int) -> Iterator[str]:
    """Stdlib .py sources in sorted path order, up to `limit` bytes (site-packages left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts)
    used = 0
    for path in paths:
        text = path.read_text(encoding="utf-8", errors="replace")
        yield text
        used += len(text.encode())
        if used >= limit:
            return


def build_tokenizer(preset: Preset) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=preset.vocab_size,
        min_frequency=2,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(preset.corpus_bytes), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        model_max_length=preset.max_position_embeddings,
    )


def build(preset: Preset, out: Path, *, weights: bool = True) -> None:
    """The model of ``preset`` in ``out``; ``weights`` false: its tokenizer files only."""
    tokenizer = build_tokenizer(preset)
    tokenizer.save_pretrained(out)
    # transformers 5 records its own class name ("TokenizersBackend"); the v4 name loads in both.
    tok_cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")
    if not weights:
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = tokenizer.get_vocab()
    ids = {name: vocab[name] for name in (BOS, EOS, PAD)}

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        max_position_embeddings=preset.max_position_embeddings,
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
        tie_word_embeddings=False,
    )
    torch.manual_seed(preset.seed)
    with torch.no_grad():
        model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
        model = model.to(getattr(torch, preset.dtype)).eval()
    model.config.dtype = preset.dtype
    model.save_pretrained(out)  # transformers 5 always writes safetensors


def marker_for(name: str, preset: Preset, *, tokenizer_only: bool = False) -> dict[str, object]:
    marker: dict[str, object] = {
        "script_version": SCRIPT_VERSION,
        "preset": name,
        "python": sys.version.split()[0],
        "params": asdict(preset),
    }
    if tokenizer_only:       # absent otherwise: models built before the flag existed stay valid
        marker["tokenizer_only"] = True
    return marker


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--force", action="store_true", help="rebuild even if DIR holds a matching build")
    ap.add_argument("--tokenizer-only", action="store_true", help="the tokenizer files alone (no torch needed)")
    args = ap.parse_args(argv)

    preset = PRESETS[args.preset]
    out: Path = args.out.resolve()
    want = marker_for(args.preset, preset, tokenizer_only=args.tokenizer_only)
    marker = out / MARKER
    if not args.force and marker.is_file():
        try:
            if json.loads(marker.read_text()) == want:
                print(f"[make_model] {out} already holds preset {args.preset!r} (v{SCRIPT_VERSION})")
                return 0
        except ValueError:
            pass
    if out.exists() and any(out.iterdir()) and not marker.is_file():
        print(f"[make_model] refusing to replace {out}: not empty, no {MARKER}", file=sys.stderr)
        return 2

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    start = time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        build(preset, tmp, weights=not args.tokenizer_only)
        (tmp / MARKER).write_text(json.dumps(want, indent=2, sort_keys=True) + "\n")
        tmp.chmod(0o755)  # mkdtemp made it 0700
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    weights = sorted(out.glob("*.safetensors"))
    for w in weights:
        print(f"[make_model] {w.name} {w.stat().st_size} bytes sha256 {sha256_file(w)}")
    print(f"[make_model] built preset {args.preset!r} in {out} in {time.monotonic() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
