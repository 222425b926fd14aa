"""Greedy training windows written by vLLM itself: the target continues each prompt as a server
does (vLLM's batched decode over its paged KV cache). On 2 CPU cores this is where a generated
data set's time goes, and vLLM's engine decodes about 2.2x the tokens/s of transformers' batched
decode (AVX512-BF16 EPYC, bf16, one shard: 577 tok/s at 256 prompts against 263 at 64; wider
transformers batches only grow its cache copies). The tokens are the served target's own, which
is what a head drafts against."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

#: prompts vLLM decodes together; wider batches stop paying once a step's weights are shared
MAX_NUM_SEQS = 256


class VllmWindows:
    """What ``train draft --generator vllm`` continues prompts with (the CLI hands the class to
    the trainer, which imports no vLLM): ``(prompts [B, P], length) -> [B, length]``
    token ids, the prompt followed by the target's greedy tokens. The engine starts on the first
    call (eager: no compile to wait for; compiled decode is within 10% at these batch widths) and
    stops on :meth:`close`."""

    def __init__(self, model: str | Path, dtype: torch.dtype, max_len: int) -> None:
        self.model = str(model)
        self.dtype = str(dtype).removeprefix("torch.")
        self.max_len = max_len
        self._llm: Any = None
        self._before: set[int] = set()  # processes that were ours before the engine's

    def kv_cache_bytes(self) -> int:
        """What :data:`MAX_NUM_SEQS` windows of ``max_len`` need, with a quarter to spare: vLLM's
        CPU engine otherwise takes most of the machine's memory for its cache (20.6 of 23.5 GiB
        here), which the teacher-forced pass beside it then has no room for."""
        import json

        from vllm_adaptive.flops import DenseShape

        cfg = json.loads((Path(self.model) / "config.json").read_text())
        shape = DenseShape.from_hf_config(cfg.get("text_config", cfg))
        itemsize = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        per_token = shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * itemsize
        return int(1.25 * per_token * MAX_NUM_SEQS * self.max_len)

    def _engine(self) -> Any:
        if self._llm is None:
            import psutil
            from vllm import LLM

            self._before = {p.pid for p in psutil.Process().children(recursive=True)}
            self._llm = LLM(
                model=self.model,
                dtype=self.dtype,
                max_model_len=self.max_len,
                max_num_seqs=MAX_NUM_SEQS,
                kv_cache_memory_bytes=self.kv_cache_bytes(),
                enable_prefix_caching=False,
                enforce_eager=True,
                seed=0,
            )
        return self._llm

    def __call__(self, prompts: torch.Tensor, length: int) -> torch.Tensor:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        new = length - prompts.shape[1]
        if new < 1 or length > self.max_len:
            raise ValueError(f"windows of {length} tokens from prompts of {prompts.shape[1]}")
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, detokenize=False)
        rows = prompts.tolist()
        outs = self._engine().generate(
            [TokensPrompt(prompt_token_ids=r) for r in rows], params, use_tqdm=False
        )
        gen = [list(o.outputs[0].token_ids) for o in outs]
        if any(len(g) != new for g in gen):
            raise RuntimeError(f"vLLM returned {sorted({len(g) for g in gen})} tokens, not {new}")
        return torch.cat([prompts.cpu(), torch.tensor(gen, dtype=prompts.dtype)], dim=1)

    def close(self) -> None:
        """Stop the engine's processes now (a training run's next hour needs the cores)."""
        if self._llm is None:
            return
        import psutil

        children = [  # the engine's own (multiprocessing's resource tracker lives until exit)
            p
            for p in psutil.Process().children(recursive=True)
            if p.pid not in self._before and p.name().startswith("VLLM::")
        ]
        self._llm.llm_engine.engine_core.shutdown()
        self._llm = None
        # shutdown() signals the engine's processes; wait for them, then make sure
        _, alive = psutil.wait_procs(children, timeout=30)
        for p in alive:
            p.kill()
