"""The package's top-level modules: model, config, checkpoint, plotting."""
