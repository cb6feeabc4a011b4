"""Greedy decoding through kvplane's engine equals HF transformers' `generate`, token for token,
with the chosen tokens' logprobs within 1e-4: a tiny random Qwen2 checkpoint (grouped-query
attention, tied embeddings, q/k/v biases, non-trivial norm weights) built here with a fixed seed,
and tiny-llama. Both are loaded by HF from their directories, offline."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.core.api import EngineRequest, LogprobRequest, SamplingParams, SchedulerConfig
from engine.core.engine_core import EngineCore
from engine.torch_runner.config import Architecture, ModelConfig
from engine.torch_runner.runner import TorchModelRunner
from tests.engine.torch_reference import (
    TEST_DEVICE,
    TINY_LLAMA,
    dense_logits,
    vllm_requests,
    write_random_qwen2,
)

# Imported by name: transformers is a dev dependency, typed as Any here (keeps mypy fast).
transformers: Any = importlib.import_module("transformers")

LOGPROB_TOLERANCE = 1e-4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclass(frozen=True, slots=True)
class Greedy:
    tokens: list[int]
    logprobs: list[float]


def hf_greedy(model_dir: Path, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[Greedy]:
    """HF `generate` (greedy, KV cache on, float32), one prompt at a time (no padding), EOS
    not stopping (as `ignore_eos`); logprobs are the log-softmax of the raw logits."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), local_files_only=True, dtype=torch.float32, output_loading_info=True
    )
    # Every tensor of the checkpoint was used and none was made up.
    assert not info["missing_keys"] and not info["unexpected_keys"]
    model.to(TEST_DEVICE).eval()
    model.generation_config.eos_token_id = None
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(
                input_ids=torch.tensor([list(prompt)], device=TEST_DEVICE),
                max_new_tokens=max_tokens,
                do_sample=False,
                use_cache=True,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            tokens = out.sequences[0, len(prompt) :].tolist()
            logprobs = [
                float(step[0].float().log_softmax(-1)[token])
                for step, token in zip(out.logits, tokens, strict=True)
            ]
            results.append(Greedy(tokens, logprobs))
    return results


def kvplane_greedy(
    model_dir: Path,
    waves: Sequence[Sequence[Sequence[int]]],
    max_tokens: int,
    *,
    block_size: int,
    max_num_batched_tokens: int,
    native_kernels: bool | None = None,
) -> tuple[list[Greedy], list[int]]:
    """Each wave's prompts run concurrently through one EngineCore (chunked prefill, batched
    decodes, prefix caching across waves). Returns results in prompt order and the cached
    prompt tokens of each request."""
    runner = TorchModelRunner.from_pretrained(
        model_dir,
        device=TEST_DEVICE,
        block_size=block_size,
        num_blocks=256,
        native_kernels=native_kernels,
    )
    core = EngineCore(
        runner, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens)
    )
    sampling = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=LogprobRequest()
    )
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    cached: dict[str, int] = {}
    order: list[str] = []
    for w, wave in enumerate(waves):
        for i, prompt in enumerate(wave):
            request_id = f"w{w}-{i}"
            order.append(request_id)
            tokens[request_id], logprobs[request_id] = [], []
            core.add_request(EngineRequest(request_id, tuple(prompt), sampling))
        while core.has_work():
            for out in core.step().outputs:
                tokens[out.request_id].extend(out.new_token_ids)
                logprobs[out.request_id].extend(lp.logprob for lp in out.logprobs or ())
                if out.usage is not None:
                    cached[out.request_id] = out.usage.cached_prompt_tokens
    assert core.load().num_running == 0
    return [Greedy(tokens[r], logprobs[r]) for r in order], [cached[r] for r in order]


def assert_same_greedy(ours: list[Greedy], theirs: list[Greedy], max_tokens: int) -> None:
    for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert len(a.tokens) == len(b.tokens) == max_tokens, index
        assert a.tokens == b.tokens, index
        assert a.logprobs == pytest.approx(b.logprobs, abs=LOGPROB_TOLERANCE), index


# Decode attention by the native kernel where it builds (None), and by torch (False).
@pytest.mark.parametrize("native_kernels", [None, False], ids=["kernel-if-built", "torch"])
def test_qwen2_greedy_matches_hf_generate(tmp_path: Path, native_kernels: bool | None) -> None:
    model_dir = write_random_qwen2(tmp_path / "qwen2")
    config = ModelConfig.from_dir(model_dir)
    assert config.architecture is Architecture.QWEN2
    assert (config.num_heads, config.num_kv_heads, config.tie_word_embeddings) == (4, 2, True)
    assert config.qkv_bias and config.rope.theta == 1e6
    g = torch.Generator().manual_seed(11)
    first = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 11, 23, 40)]
    # The second wave extends first-wave prompts: its prefixes come from the prefix cache.
    second = [[*first[3], 7, 8, 9], [*first[2][:20], 250, 251, 252, 253, 254]]
    max_tokens = 16
    ours, cached = kvplane_greedy(
        model_dir,
        [first, second],
        max_tokens,
        block_size=4,
        max_num_batched_tokens=24,
        native_kernels=native_kernels,
    )
    assert_same_greedy(ours, hf_greedy(model_dir, first + second, max_tokens), max_tokens)
    assert cached[4:] == [40, 20]
    # Greedy text that does not depend on the model would not test anything.
    assert len({tuple(r.tokens) for r in ours}) == len(ours)


@pytest.mark.parametrize("native_kernels", [None, False], ids=["kernel-if-built", "torch"])
def test_tiny_llama_greedy_matches_hf_generate(native_kernels: bool | None) -> None:
    requests = vllm_requests()
    prompts = [requests[i]["prompt_token_ids"] for i in (0, 5, 11, 20, 27)]
    max_tokens = 24
    ours, _ = kvplane_greedy(
        TINY_LLAMA,
        [prompts],
        max_tokens,
        block_size=16,
        max_num_batched_tokens=96,
        native_kernels=native_kernels,
    )
    assert_same_greedy(ours, hf_greedy(TINY_LLAMA, prompts, max_tokens), max_tokens)


@pytest.mark.parametrize("native_kernels", [None, False], ids=["kernel-if-built", "torch"])
def test_a_long_cold_prompt_in_one_step_matches_hf_and_its_prompt_logprobs(
    native_kernels: bool | None,
) -> None:
    """A cold 700-token prompt prefilled in one step takes the fresh-prefill attention (causal
    SDPA on the step's own keys: past 512 keys with the native kernels, from 64 tokens
    without), and the LM head runs only on the rows that need logits. Greedy tokens and their
    logprobs equal HF's; asked for, the prompt logprobs (a logit row per prompt position)
    equal a float64 dense forward's, and the greedy output is the same with or without them."""
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 1024, (700,), generator=g).tolist()
    max_tokens = 8
    runner = TorchModelRunner.from_pretrained(
        TINY_LLAMA, device=TEST_DEVICE, block_size=16, num_blocks=64, native_kernels=native_kernels
    )
    results: list[tuple[Greedy, tuple[float, ...]]] = []
    for with_prompt_logprobs in (False, True):
        core = EngineCore(runner, SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=1024))
        sampling = SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            logprobs=LogprobRequest(),
            prompt_logprobs=LogprobRequest() if with_prompt_logprobs else None,
        )
        core.add_request(EngineRequest("long", tuple(prompt), sampling))
        tokens: list[int] = []
        logprobs: list[float] = []
        scored: tuple[float, ...] = ()
        while core.has_work():
            for out in core.step().outputs:
                tokens.extend(out.new_token_ids)
                logprobs.extend(lp.logprob for lp in out.logprobs or ())
                if out.prompt_logprobs is not None:
                    scored = tuple(lp.logprob for lp in out.prompt_logprobs if lp is not None)
        results.append((Greedy(tokens, logprobs), scored))
    (plain, none), (with_prompt, scored) = results
    assert none == ()
    assert_same_greedy([plain, with_prompt], hf_greedy(TINY_LLAMA, [prompt] * 2, max_tokens), 8)
    expected = dense_logits(TINY_LLAMA, prompt).log_softmax(-1)[:-1]
    expected = expected.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert len(scored) == len(prompt) - 1
    assert list(scored) == pytest.approx(expected.tolist(), abs=LOGPROB_TOLERANCE)
