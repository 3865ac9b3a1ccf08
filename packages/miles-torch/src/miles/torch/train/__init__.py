"""The FSDP2 train backend: `fsdp.FSDPTrainer` (one per rank) and its config `config.FSDPConfig`.

Nothing is imported here, so reading the config section does not pull in torch or transformers.
"""
