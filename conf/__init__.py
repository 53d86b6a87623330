# Makes the config tree importable as ``relax_launch.conf`` (Hydra's pkg:// search path).
