"""The transformers cache-layer operations numbakv's generation caches refuse, written once for
the attention layers (:mod:`numbakv.hf.generation`) and the recurrent ones
(:mod:`numbakv.hf.recurrent`): each names what to do instead of silently keeping stale rows."""

from __future__ import annotations

from ..errors import KVCacheError


class RefusedLayerOps:
    """Mixed in before a transformers cache layer class (first in the MRO, so these win)."""

    def reset(self) -> None:
        raise KVCacheError("a numbakv generation cache is not reset: make a new one per "
                           "generate() call (hf.generation_cache)")

    def reorder_cache(self, beam_idx) -> None:
        raise KVCacheError("beam search is not supported by numbakv's generation cache "
                           "(num_beams=1)")

    def crop(self, tokens_to_remove: int) -> None:
        raise KVCacheError("cropping (assisted decoding) is not supported by numbakv's "
                           "generation cache")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise KVCacheError("num_return_sequences > 1 / num_beams > 1 are not supported "
                               "by numbakv's generation cache: repeat the rows of input_ids")

    def batch_select_indices(self, indices) -> None:
        raise KVCacheError("selecting batch rows is not supported by numbakv's generation "
                           "cache")
