"""How the run's processes are started and reached: Ray actor groups, handles that work with or without Ray, Ray's error classes, GPU placement, HTTP auth."""
