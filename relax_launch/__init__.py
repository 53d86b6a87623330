"""``python -m relax_launch``: compose the config, validate it, start Ray and run the experiment."""
