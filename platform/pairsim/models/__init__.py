"""Models: open_clip architectures (:mod:`.clip`), fusion modules (:mod:`.fusion`) and the
retrieval model with its heads and export format (:mod:`.retrieval`)."""
