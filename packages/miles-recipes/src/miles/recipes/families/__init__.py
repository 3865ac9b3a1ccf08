"""Model families: what Miles needs to know about a transformers architecture beyond its weights.

Today that is the MoE router (for routing replay). One module per family, each a few lines.
"""
