"""The contracts a plugin implements: hookspecs, component specs (capabilities, memory models),
the backend protocols, data types, model families, recipes, the weight-sync plan and the RL math
backends share."""
