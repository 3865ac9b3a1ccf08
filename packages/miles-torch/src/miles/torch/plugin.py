"""miles-torch' plugin module: the components it registers."""
