"""Know: the allocator's API, named and shaped as ``torch.cuda``'s.

``api`` (counters, summaries, snapshots, settings, raw allocations, ``Buffer``), ``compat``
(the rest of ``torch.cuda.memory``'s public names), ``mempool`` (``MemPool``,
``use_mem_pool``) and ``cache`` (``clear_cache``). Users reach all of them from the top-level
``vramkit`` namespace, as they reach ``torch.cuda``'s.
"""
