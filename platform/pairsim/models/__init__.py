"""Models: open_clip architectures (:mod:`.clip`), fusion modules (:mod:`.fusion`), the
retrieval model with its heads and export format (:mod:`.retrieval`), and the model card and
file checks of a saved model (:mod:`.saved`)."""
