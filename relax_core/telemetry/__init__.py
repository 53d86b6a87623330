"""Where a run's numbers and messages go: metrics sinks and notifications."""
