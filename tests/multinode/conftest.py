"""Multi-node tests run on clusters of network namespaces built by ``netns_cluster.py`` (Ray) and
``slurm_nodes.py`` (Slurm); each test module starts the cluster shape it needs."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
