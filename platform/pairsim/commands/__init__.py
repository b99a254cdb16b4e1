"""The bodies of the ``pairsim`` commands, by what they work on: :mod:`~pairsim.commands.runs`
(``demo``, ``train``, ``tune``, ``extract-teacher``), :mod:`~pairsim.commands.trained`
(``evaluate``, ``export``, ``checkpoints``), :mod:`~pairsim.commands.datasets` (``shards``,
``data synth``), and the argument types and flags they share (:mod:`~pairsim.commands.arguments`).
The parser, ``doctor``, ``registry`` and the error boundary are :mod:`pairsim.cli`'s."""
