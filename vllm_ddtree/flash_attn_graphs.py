"""Which CUDA graphs FlashAttention may be replayed in on vLLM 0.26's V2 model runner.

vLLM's FlashAttention builder declares FA3's graph support ALWAYS: whole-forward
(FULL) graphs for any batch, prefills included. On the V2 model runner of vLLM
0.26.0 that does not hold. With ``cudagraph_mode=FULL`` (graphs up to 1024 tokens)
SmolLM2-135M in bf16 on an H200 generated other greedy tokens than eager execution
from the first token on, for 3 of 4 prompts prefilled together, with the series not
applied
(``bench/results/2026-11-30-flash-attn-full-graphs-pristine-check/graph-mode-outputs-pristine.json``:
"0, 736, 736, 736, ..." where eager gives "281, 216, 34, ..."); with the series, plain decoding in
that mode differed from vLLM's default graphs from the first token in 16 of 16
requests at 4 concurrent requests, and the DFlash chain in it accepted 0.4 % of its
drafts (``bench-steady-b4-default-graph-reference.json.gz``). vLLM's default mode
(FULL_AND_PIECEWISE: FULL graphs for uniform decode steps, piecewise graphs around an
eagerly launched attention for the rest) gave the same tokens as every other
reference in those runs.

The likely cause, read in the sources (not confirmed on the GPU): the V2 runner
captures a mixed FULL graph on a dummy batch of equal query lengths and takes
``max_query_len`` from it (``model_states/default.py``), where the V1 runner uses the
graph's token count; FlashAttention's launch takes ``max_seqlen_q`` as a host integer,
so the graph replays longer prompts with the capture's smaller value.

So on the V2 runner FA3's support is reported as UNIFORM_BATCH, as vLLM already
reports it for FA2: vLLM's own mode resolution then turns a requested FULL into
FULL_AND_PIECEWISE (with its warning), and the DFlash drafter, which only needs
uniform-batch graphs, keeps its FULL graphs. The V1 runner keeps the declared value.
"""

from __future__ import annotations

from typing import Any


def flash_attn_cudagraph_support(declared: Any, vllm_config: Any) -> Any:
    """The graph support FlashAttention's metadata builder reports (patch
    attention_flash-attn-no-full-graphs-for-prefills-on-v2): ``declared`` (vLLM's
    value, an ``AttentionCGSupport``) capped at UNIFORM_BATCH on the V2 runner."""
    from vllm.v1.attention.backend import AttentionCGSupport

    if not getattr(vllm_config, "use_v2_model_runner", False):
        return declared
    if declared.value > AttentionCGSupport.UNIFORM_BATCH.value:
        return AttentionCGSupport.UNIFORM_BATCH
    return declared
