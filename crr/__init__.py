"""crr: Counterfactual Rollout Replay for software-engineering agents."""

__version__ = "0.1.0"
