"""DDTree speculator for vLLM's V2 model runner (``vllm/v1/worker/gpu``).

The hook in ``vllm/v1/worker/gpu/spec_decode/__init__.py`` (patch
``spec-decode_ddtree-config``) constructs :class:`DDTreeSpeculator` for
``method="ddtree"``. Until tree drafting, tree verification and KV compaction are
wired into the runner, a valid DDTree configuration stops here with a plain error
instead of silently running the DFlash chain.
"""


class DDTreeSpeculator:
    def __init__(self, vllm_config, device):
        raise NotImplementedError(
            "DDTree speculative decoding (method='ddtree') is not implemented yet in "
            "this vllm-ddtree build; use method='dflash' for the DFlash chain."
        )
