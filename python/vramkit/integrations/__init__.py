"""vramkit where PyTorch users already are: Hugging Face's Trainer, Lightning, notebooks.

Each integration imports its framework only when used, through the framework's own public
extension points; vramkit itself never needs them installed.
"""
