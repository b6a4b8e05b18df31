"""The soak uses the P/D suite's tiny model fixture."""

from tests.pd.conftest import tiny_model

__all__ = ["tiny_model"]
