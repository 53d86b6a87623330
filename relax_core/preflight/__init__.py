"""What is checked before launch: cross-field config rules and the per-role memory estimate."""
