"""Relax reward hub: verifiers behind one interface (``get``/``available``), plug-ins and an executor."""
