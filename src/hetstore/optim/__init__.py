"""The optimizer side: steps on flat fp32 master buffers wherever they live."""

from hetstore.optim.loss_scaler import DynamicLossScaler
from hetstore.optim.offloaded import OffloadedOptimizer

__all__ = ["OffloadedOptimizer", "DynamicLossScaler"]
