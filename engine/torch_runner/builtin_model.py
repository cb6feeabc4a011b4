"""The builtin model: a tiny deterministic random Llama that kvplane builds on first use.

`kvplane up` needs a real model on a fresh clone without downloads. `ensure_builtin_model()`
writes a small `LlamaForCausalLM` checkpoint in Hugging Face layout (config.json,
generation_config.json, model.safetensors, tokenizer.json) under the model cache
(`$KVPLANE_CACHE_DIR/models`, else `$XDG_CACHE_HOME/kvplane/models`, else
`~/.cache/kvplane/models`) and returns its directory; later calls reuse it. Engines get it
with `model: builtin` in their config.

Everything is a pure function of this file: weights come from numpy's PCG64 generator with a
fixed seed, and the tokenizer is a byte-level BPE whose merges are learnt here, with a fixed
tie-break, from the fixed text below: the same bytes on every machine and every run. The
weights are random, so the text it writes is gibberish; it exists to exercise the serving
path (prefill, paged KV cache, prefix caching, streaming, text in and out) at full speed on a
laptop. The directory is built in a temporary folder and renamed into place, so concurrent
first uses (three engines starting at once) never see a half-written model; a build stopped
by SIGTERM (Ctrl-C in `kvplane up` while its engines start) removes that folder before the
process ends.

torch-free (numpy, safetensors, tokenizers).
"""

from __future__ import annotations

import collections
import itertools
import json
import shutil
import tempfile
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from engine.torch_runner.errors import CheckpointError
from engine.torch_runner.first_use import cache_root, sigterm_unwinds

BUILTIN_MODEL = "builtin"
BUILTIN_MODEL_NAME = "tiny-llama-builtin-v1"

SEED = 20240601
HIDDEN_SIZE = 256
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 2
INTERMEDIATE_SIZE = 704
MAX_POSITION_EMBEDDINGS = 4096
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2 (Llama's convention)
BOS_ID, EOS_ID = 1, 2
MAX_MERGES = 253  # 3 special + 256 bytes + 253 merges = 512 ids at most

# The text the tokenizer's merges are learnt from (fixed: changing it changes the model, so
# bump BUILTIN_MODEL_NAME's version with it).
_CORPUS = """\
kvplane routes every request to the engine that already holds its prefix in its KV cache.
The controller knows the fleet, reads each engine's load, and keeps an index of the blocks
that every engine has cached. A request that shares a system prompt with earlier requests
is sent where that prompt already lives, without overloading anyone. When the fleet is
busy, the router spreads the work; when an engine drains, it leaves routing at once.
The quick brown fox jumps over the lazy dog. The five boxing wizards jump quickly.
You are a helpful assistant. Answer the question below in one short paragraph.
def parse(self, text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line]

class Parser:
    def __init__(self, name: str) -> None:
        self.name = name

    def feed(self, data: bytes) -> None:
        for value in data:
            self.values.append(value)

for i in range(10):
    print(i, i * i)
"""


def default_cache_dir() -> Path:
    """Where models are cached: `models` under kvplane's cache (`first_use.cache_root`)."""
    return cache_root() / "models"


def ensure_builtin_model(cache_dir: Path | None = None) -> Path:
    """The builtin model's directory under `cache_dir` (default: `default_cache_dir()`),
    built there first if it is not there yet."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / BUILTIN_MODEL_NAME
    if (target / "config.json").is_file():
        return target
    try:
        with sigterm_unwinds():
            return _build_into(root, target)
    except OSError as exc:
        raise CheckpointError(
            f"cannot build the builtin model under {root} ({exc}); set KVPLANE_CACHE_DIR "
            "to a writable folder"
        ) from exc


def _build_into(root: Path, target: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{BUILTIN_MODEL_NAME}-", dir=root))
    try:
        write_builtin_model(scratch)
        scratch.chmod(0o755)  # mkdtemp's 0700 would hide it from the cache's other readers
        try:
            scratch.rename(target)
        except OSError:
            # Another process got there first (the target exists and is not empty).
            if not (target / "config.json").is_file():
                raise
    finally:
        if scratch.exists():
            shutil.rmtree(scratch, ignore_errors=True)
    return target


def write_builtin_model(directory: Path) -> Path:
    """Write the builtin checkpoint into `directory` (created if needed)."""
    import numpy as np
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    head_dim = HIDDEN_SIZE // NUM_HEADS
    rng = np.random.default_rng(SEED)

    def randn(*shape: int) -> np.ndarray:
        values = rng.standard_normal(shape, dtype=np.float32)
        return (values / np.float32(np.sqrt(shape[-1]))).astype(np.float32)

    def ones(size: int) -> np.ndarray:
        return np.ones(size, dtype=np.float32)

    hidden, inter = HIDDEN_SIZE, INTERMEDIATE_SIZE
    state = {"model.embed_tokens.weight": randn(vocab_size, hidden)}
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}."
        state[p + "input_layernorm.weight"] = ones(hidden)
        state[p + "post_attention_layernorm.weight"] = ones(hidden)
        state[p + "self_attn.q_proj.weight"] = randn(NUM_HEADS * head_dim, hidden)
        state[p + "self_attn.k_proj.weight"] = randn(NUM_KV_HEADS * head_dim, hidden)
        state[p + "self_attn.v_proj.weight"] = randn(NUM_KV_HEADS * head_dim, hidden)
        state[p + "self_attn.o_proj.weight"] = randn(hidden, NUM_HEADS * head_dim)
        state[p + "mlp.gate_proj.weight"] = randn(inter, hidden)
        state[p + "mlp.up_proj.weight"] = randn(inter, hidden)
        state[p + "mlp.down_proj.weight"] = randn(hidden, inter)
    state["model.norm.weight"] = ones(hidden)
    state["lm_head.weight"] = randn(vocab_size, hidden)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": head_dim,
        "vocab_size": vocab_size,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": "float32",
    }
    generation = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID}
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (directory / "generation_config.json").write_text(
        json.dumps(generation, indent=2, sort_keys=True) + "\n"
    )
    (directory / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n")
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-level alphabet: printable bytes stand for themselves, the others are moved
    to code points from 256 up, in byte order (the convention of byte-level BPE files)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _learn_merges(words: collections.Counter[str], alphabet: set[str]) -> list[tuple[str, str]]:
    """Greedy BPE: merge the most frequent adjacent pair (ties: the smallest pair) while some
    pair occurs at least twice, at most MAX_MERGES times."""
    pieces = {word: list(word) for word in words}
    if any(ch not in alphabet for word in words for ch in word):
        raise ValueError("the corpus must be pre-tokenized to the byte-level alphabet")
    merges: list[tuple[str, str]] = []
    while len(merges) < MAX_MERGES:
        counts: collections.Counter[tuple[str, str]] = collections.Counter()
        for word, parts in pieces.items():
            for pair in itertools.pairwise(parts):
                counts[pair] += words[word]
        if not counts:
            break
        best = min(counts, key=lambda pair: (-counts[pair], pair))
        if counts[best] < 2:
            break
        merges.append(best)
        joined = best[0] + best[1]
        for word, parts in pieces.items():
            merged: list[str] = []
            i = 0
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best:
                    merged.append(joined)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            pieces[word] = merged
    return merges


def build_tokenizer() -> Tokenizer:
    """The builtin byte-level BPE tokenizer."""
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    byte_chars = _bytes_to_unicode()
    words = collections.Counter(piece for piece, _ in pre.pre_tokenize_str(_CORPUS))
    merges = _learn_merges(words, set(byte_chars.values()))
    vocab: dict[str, int] = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for b in range(256):
        vocab[byte_chars[b]] = len(vocab)
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None))
    tokenizer.pre_tokenizer = pre
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    return tokenizer
