"""The offline API people know from vLLM: `LLM(...).generate(...)` and `.chat(...)`."""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from enginecore.config import EngineArgs
from enginecore.engine import LLMEngine
from enginecore.outputs import RequestOutput
from enginecore.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """An in-process engine. `model=None` is the embedded SmolLM2-135M-Instruct.

    Engine arguments are the CLI flags with underscores, e.g.
    ``LLM(backend="torch", max_num_seqs=8, enable_prefix_caching=False)``.
    """

    def __init__(self, model: str | None = None, backend: str = "auto", platform: str = "auto", **engine_args: Any):
        args = EngineArgs.from_kwargs(model=model, backend=backend, platform=platform, **engine_args)
        self.engine_args = args
        self.llm_engine = LLMEngine.from_engine_args(args)
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer.hf

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """prompts: a string, a list of strings, one list of token ids, or a list of those."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        elif prompts and isinstance(prompts, (list, tuple)) and all(isinstance(t, int) for t in prompts):
            prompts = [list(prompts)]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
        ids = []
        for i, (p, sp) in enumerate(zip(prompts, sampling_params)):
            sp = sp.clone()
            sp.output_kind = RequestOutputKind.FINAL_ONLY
            rid = str(next(self._counter))
            self.llm_engine.add_request(rid, p, sp, priority=priority[i] if priority else 0)
            ids.append(rid)
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.llm_engine.tokenizer
        prompts = []
        for conv in convs:
            text = tok.apply_chat_template(
                conv, chat_template, add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message, **(chat_template_kwargs or {}),
            )
            prompts.append({"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(ids) > 1:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        eng = self.llm_engine
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out
                    if bar:
                        bar.update(1)
        if bar:
            bar.close()
        return [done[i] for i in ids]

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.core.reset_prefix_cache()
