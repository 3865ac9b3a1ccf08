"""The plugin registry: discovery through the `miles` entry-point group, the components it holds,
building them from config, the model-family lookup, and checking a config against it."""
