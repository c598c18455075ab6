"""vitlab: a from-scratch Vision Transformer research framework, checked against timm."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # Imported on first use: `import vitlab` stays free of torch and timm.
    if name == "create_model":
        from vitlab.convert.timm_create import create_model

        return create_model
    raise AttributeError(f"module 'vitlab' has no attribute {name!r}")


__all__ = ["__version__", "create_model"]
