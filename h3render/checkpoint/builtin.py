"""The built-in random models ("tiny", "small") as a checkpoint source: deterministic per-tensor weights in
checkpoint naming, made on read (`random_entries`), and the small byte-level tokenizer they use. No files, no
downloads.

`checkpoint.load.build_random(...)` in memory and `make_checkpoint.writer.make_checkpoint(...)` on disk give
identical weights for the same seed: both read `random_entries`, and `build_random` loads them through the loader's
own strict streaming path.
"""

from __future__ import annotations

import functools
import math
import zlib
from typing import Callable, Iterator

import torch
from torch import Tensor, nn

from h3render.checkpoint.releases import Release
from h3render.checkpoint.stream import Entry, parameters_on_meta
from h3render.models.audio_vae import AudioVAE
from h3render.models.dit import DiT
from h3render.models.text_encoder import VISION_TOKENS, add_vision_tokens
from h3render.models.video_vae import VideoVAE

# Storage dtypes of the release: DiT bf16 except the fp32 islands (patch projections, time embedder, output heads);
# text encoder bf16; both VAEs fp32 (DESIGN.md §1).


def dit_storage_dtype(name: str) -> torch.dtype:
    """Release storage dtype of a native DiT tensor."""
    return torch.float32 if name.startswith(tuple(m + "." for m in DiT.FP32_MODULES)) else torch.bfloat16


STORAGE_DTYPES: dict[str, Callable[[str], torch.dtype]] = {
    "dit": dit_storage_dtype,
    "dit_ref": dit_storage_dtype,  # ref2va's DiT partition (`transformer_ref`): same architecture, own weights
    "text_encoder": lambda name: torch.bfloat16,
    "video_vae": lambda name: torch.float32,
    "audio_vae": lambda name: torch.float32,
}


def random_tensor(component: str, name: str, shape: tuple[int, ...], seed: int) -> Tensor:
    """Deterministic random tensor for one checkpoint tensor, rounded to the release storage dtype.

    Each tensor has its own generator, seeded from `(seed, component, name)`, so a subset of a model (the text
    encoder without its vision tower) gets the same values as the whole. Scale: biases N(0, 0.02²), gains (1-D
    weights, weight-norm `weight_g`) 1 + N(0, 0.1²), matrices and kernels N(0, 1/fan_in).

    Args:
        component: "dit" | "text_encoder" | "video_vae" | "audio_vae"; name: the tensor's name in the checkpoint
            (native DiT names, `model.language_model.*` text names, diffusers VAE names).

    Returns:
        CPU tensor of `shape` in the storage dtype.
    """
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{component}/{name}".encode()))
    x = torch.randn(shape, generator=generator, dtype=torch.float32)
    if name.endswith("bias"):
        x = 0.02 * x
    elif len(shape) <= 1 or name.endswith("weight_g"):
        x = 1.0 + 0.1 * x
    else:
        x = x / math.sqrt(math.prod(shape[1:]))
    return x.to(STORAGE_DTYPES[component](name))


def _template(component: str, release: Release) -> nn.Module:
    """One component as stored in a checkpoint, parameters on meta, persistent buffers computed. The text encoder
    is the whole Qwen3-VL (vision tower, all layers, final norm, LM head), as released."""
    with parameters_on_meta():
        if component in ("dit", "dit_ref"):
            return DiT(release.dit)
        if component == "video_vae":
            return VideoVAE(release.video_vae)
        if component == "audio_vae":
            return AudioVAE(release.audio_vae)
        if component == "text_encoder":
            from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

            return Qwen3VLForConditionalGeneration(Qwen3VLConfig.from_dict(dict(release.text_encoder)))
    raise ValueError(f"unknown component {component!r}")


def random_entries(component: str, release: Release, seed: int) -> Iterator[Entry]:
    """Entries of a built-in random component in checkpoint naming and module order, generated on read.

    Parameters are `random_tensor`s; persistent buffers (the audio VAE's anti-aliasing filters and zero k-bias)
    carry the values the module computes, as a saved checkpoint does."""
    where = f"<builtin {release.name} seed {seed}>"
    template = _template(component, release)
    storage = STORAGE_DTYPES[component]
    for name, tensor in template.state_dict().items():
        if tensor.is_meta:
            load = functools.partial(random_tensor, component, name, tuple(tensor.shape), seed)
        else:
            load = functools.partial(lambda t, d: t.to(d), tensor, storage(name))
        yield Entry(where, name, load)


# A fixed corpus for the built-in byte-level BPE tokenizer (no downloads; same merges every time).
_TOKENIZER_CORPUS = (
    "A red fox runs through a snowy forest at dawn, its breath visible in the cold air.",
    "Waves crash against black rocks while gulls cry overhead and the wind carries salt spray.",
    "A street musician plays a slow song on a violin; people stop, listen, and drop coins in the case.",
    "Rain falls on a quiet city at night. Neon signs reflect in the puddles, a car passes, tyres hissing.",
    "The camera pans over green hills to a small white house. A dog barks; children laugh in the distance.",
    "Close-up of hands kneading dough on a wooden table, flour in the air, a kettle whistling behind.",
)


@functools.lru_cache(maxsize=None)
def _tiny_tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(_TOKENIZER_CORPUS * 4, trainer=trainer)
    return tokenizer.to_str()


def tiny_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer trained in memory on a fixed corpus (any text encodes; ids < `vocab_size`),
    as a transformers fast tokenizer."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tiny_tokenizer_json(vocab_size)))


def tiny_vl_tokenizer(vocab_size: int = 512):
    """The built-in models' tokenizer with the vision tokens: `tiny_tokenizer` trained to `vocab_size - 4` ids, plus
    the four vision special tokens, so every id stays below `vocab_size`."""
    tokenizer = add_vision_tokens(tiny_tokenizer(vocab_size - len(VISION_TOKENS)))
    if len(tokenizer) > vocab_size:
        raise ValueError(f"tiny tokenizer has {len(tokenizer)} ids for a vocabulary of {vocab_size}")
    return tokenizer
