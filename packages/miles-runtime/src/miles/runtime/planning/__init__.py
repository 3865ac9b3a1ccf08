"""The GPU memory plan of a run, before anything starts."""
