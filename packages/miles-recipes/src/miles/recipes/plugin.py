"""miles-recipes' plugin module: the components it registers."""
