"""An example third-party Miles plugin."""
