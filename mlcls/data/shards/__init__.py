"""Packed tar shards (``dataset=shards``): writing them (:mod:`.pack`), reading tar members safely
(:mod:`.tario`), opening and checking a pack (:mod:`.reader`), its training and evaluation datasets
(:mod:`.datasets`) and the training read order (:mod:`.loader`)."""
