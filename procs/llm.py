"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any, Self

from tqdm import tqdm

from bastion.core.config import EngineConfig, build_engine_config
from bastion.core.engine_core import EngineCore
from bastion.core.executor import Executor, UniProcExecutor
from bastion.core.loader import (
    get_max_model_len,
    load_generation_defaults,
    load_tokenizer,
    resolve_model,
)
from bastion.core.output_processor import OutputProcessor, fan_out
from bastion.core.outputs import RequestOutput
from bastion.ipc.messages import LoRARequest, SamplingParams
from bastion.procs.logs import console_logging

PromptType = str | list[int] | dict[str, Any]
logger = logging.getLogger(__name__)


class LLM:
    """An engine in this process, for batch generation.

    ``LLM()`` with no model runs the embedded SmolLM2-135M-Instruct. Keyword arguments are the
    engine options (``max_model_len``, ``block_size``, ``max_num_batched_tokens``, ...).
    Loading logs its phases to stderr (with a bar on a terminal) unless the program has set up
    logging itself.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        console_logging()
        start = time.perf_counter()
        self.config: EngineConfig = build_engine_config("llm", model=model, **kwargs)
        resolved = resolve_model(self.config.model)
        self.max_model_len = get_max_model_len(resolved.hf_config, self.config.model.max_model_len)
        self.tokenizer = None
        if not self.config.model.skip_tokenizer_init:
            self.tokenizer = load_tokenizer(self.config.model, resolved)
        self.generation_defaults = load_generation_defaults(self.config.model, resolved)
        self.eos_token_id = getattr(self.tokenizer, "eos_token_id", None)
        if self.eos_token_id is None:
            self.eos_token_id = getattr(resolved.hf_config, "eos_token_id", None)
            if isinstance(self.eos_token_id, list):
                self.eos_token_id = self.eos_token_id[0]
        self._runtime_dir: str | None = None
        self.engine: EngineCore | None = None
        executor = self._make_executor()
        try:
            self.engine = EngineCore(self.config, executor, self.max_model_len,
                                     tokenizer=self.tokenizer)
        except BaseException:
            executor.shutdown()
            self._remove_runtime_dir()
            raise
        self._counter = itertools.count()
        logger.info("LLM ready in %.1f s", time.perf_counter() - start)

    def _make_executor(self) -> Executor:
        """In this process for one device; worker processes (one per TP rank) otherwise, or
        when ``distributed_executor_backend="mp"``."""
        parallel = self.config.parallel
        backend = parallel.distributed_executor_backend or (
            "uni" if parallel.tensor_parallel_size == 1 else "mp")
        if backend == "uni":
            return UniProcExecutor(self.config)
        from bastion.procs.executor import MultiprocExecutor
        from bastion.procs.lifecycle import make_runtime_dir

        self._runtime_dir = make_runtime_dir()
        try:
            return MultiprocExecutor(self.config, self._runtime_dir, engine_id=0)
        except BaseException:
            self._remove_runtime_dir()
            raise

    def _remove_runtime_dir(self) -> None:
        from bastion.procs.lifecycle import remove_runtime_dir

        remove_runtime_dir(self._runtime_dir)
        self._runtime_dir = None

    def shutdown(self) -> None:
        """Stop the worker processes (if any) and remove their socket directory; idempotent."""
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown()
        self._remove_runtime_dir()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        # Best effort for callers that never shut down; worker processes also die with us.
        with contextlib.suppress(Exception):
            self.shutdown()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (vLLM's rule:
        ``generation_config="vllm"`` ignores them)."""
        return SamplingParams(**self.generation_defaults)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or ``{"prompt_token_ids": [...]}``) as one
        continuously batched workload; results come back in prompt order. ``use_tqdm``: a
        progress bar of finished prompts on stderr. ``lora_request``: the adapter of every
        prompt, or one per prompt (None: the base model); loaded on first use."""
        if self.engine is None:
            raise RuntimeError("this LLM was shut down; create a new one")
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or self.get_default_sampling_params()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        loras = (list(lora_request) if isinstance(lora_request, Sequence)
                 else [lora_request] * len(prompts))
        if len(loras) != len(prompts):
            raise ValueError("give one LoRARequest, or one per prompt")
        for lora in {r.lora_int_id: r for r in loras if r is not None}.values():
            self.engine.add_lora(lora)
        processor = OutputProcessor(self.tokenizer)
        results: dict[str, RequestOutput] = {}
        order = []
        for prompt, p, lora in zip(prompts, params_list, loras):
            text, token_ids = self._tokenize(prompt)
            parent = str(next(self._counter))
            order.append(parent)
            children = fan_out(parent, token_ids, p, self.eos_token_id, time.time(),
                               lora_request=lora)
            choices = [processor.add(req, parent, i) for i, req in enumerate(children)]
            results[parent] = RequestOutput(parent, text, token_ids, choices)
            for req in children:
                self.engine.add_request(req)
        bar = tqdm(total=len(order), desc="Processed prompts", unit="prompt",
                   disable=not use_tqdm, dynamic_ncols=True)
        num_open = {parent: len(results[parent].outputs) for parent in order}
        try:
            self._run(processor, results, num_open, bar)
        except BaseException:
            self._drop_all_requests()
            raise
        return [results[parent] for parent in order]

    def _run(self, processor: OutputProcessor, results: dict[str, RequestOutput],
             num_open: dict[str, int], bar: tqdm) -> None:
        """Step the engine until every request has finished."""
        with bar:
            while self.engine.has_unfinished_requests or processor.seqs:
                step = self.engine.step()
                to_abort = []
                for out in step.outputs:
                    delta, must_abort = processor.process(out)
                    if delta is None:
                        continue
                    result = results[delta.parent_id]
                    result.num_cached_tokens = max(result.num_cached_tokens,
                                                   out.num_cached_tokens)
                    if must_abort:
                        to_abort.append(out.request_id)
                    if delta.finish_reason is not None:
                        num_open[delta.parent_id] -= 1
                        if not num_open[delta.parent_id]:
                            bar.update(1)
                if to_abort:
                    self.engine.abort_requests(to_abort)
                if not step.outputs and not self.engine.has_unfinished_requests:
                    break

    def _drop_all_requests(self) -> None:
        """After a step raised (or was interrupted: Ctrl-C, a test's timeout): forget every
        request and every step in flight, in the engine and its runners, as a server's fault
        recovery does.

        NOTE: a step can stop anywhere, e.g. between a grammar step's sampling and the launch
        of the step held behind it; kept, those half-done steps would fail the next
        ``generate`` ('step N was asked for its tokens before it sampled')."""
        self.engine.drop_all_requests()
        try:
            self.engine.executor.reset()
        except Exception:  # the step's own error is the one to raise
            logger.exception("resetting the runners after a failed step failed")

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        # The template already holds every special token, so nothing more is added.
        prompts = [{"prompt": text, "prompt_token_ids": self.tokenizer.encode(
                        text, add_special_tokens=False)}
                   for text in (self.tokenizer.apply_chat_template(
                       c, tokenize=False, add_generation_prompt=add_generation_prompt)
                       for c in conversations)]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (skip_tokenizer_init is set)")
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)
