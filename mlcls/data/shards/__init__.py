"""Packed tar shards (``dataset=shards``): writing them (:mod:`.pack`), reading tar members safely
(:mod:`.tario`), opening and checking a pack (:mod:`.reader`), its training and evaluation datasets
(:mod:`.datasets`), the training loader (:mod:`.loader`) and the full check (:mod:`.verify`)."""
