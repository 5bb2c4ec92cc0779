"""The `vramkit` command: one module per subcommand.

``main`` (the parser and the dispatch), ``run`` (`vramkit run`, with ``run_torch`` for the
script's torch tensors), ``predict`` (`vramkit fit` and `vramkit replay`), ``smi``
(`vramkit smi`) and ``common`` (what they share). Entry points: the ``vramkit`` console
script and ``python -m vramkit`` both call ``vramkit.commands.main.main``.
"""
