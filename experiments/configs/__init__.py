"""ml_collections config files (`get_config()`), one per experiment."""
