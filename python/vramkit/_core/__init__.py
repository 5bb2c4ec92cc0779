"""The lowest layer of the Python package: what every capability shares.

``errors`` (the exceptions the C module raises), ``devices`` (the default device, counts),
``files`` (report files written atomically) and ``plain_pickle`` (reading a pickle without
running code from it). Nothing here imports any other part of vramkit except the extension
module ``vramkit._C``; see docs/architecture.md for the layer rule.
"""
