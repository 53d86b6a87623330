"""The typed config (one dataclass per config group) and the implementations a user picks by name."""
