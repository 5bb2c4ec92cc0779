"""The `vramkit` command: one module per subcommand.

``main`` (the parser and the dispatch), ``run`` (`vramkit run`, with ``run_torch`` for the
script's torch tensors and ``run_ranks`` for a rank of a torchrun job), ``merge`` (`vramkit
merge`, the merged report of the ranks), ``rank_report`` (the JSON summary each rank writes),
``predict`` (`vramkit fit` and `vramkit replay`), ``smi`` (`vramkit smi`) and ``common`` (what
they share). Entry points: the ``vramkit`` console script and ``python -m vramkit`` both call
``vramkit.commands.main.main``.
"""
