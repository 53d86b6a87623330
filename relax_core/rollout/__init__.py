"""The rollout side of a run: the engine pool and its elastic scaling, the control plane, the GenRM judge engines."""
